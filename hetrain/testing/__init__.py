"""Stand-ins for what cannot exist on one machine, for the tests, the demo and its test bed: a cloud's
metadata endpoint (``fakecloud``), nodes as network namespaces (``netbed``) and a shaped link (``relay``).
Production code never imports this package (an import-linter contract holds it to that).
"""
