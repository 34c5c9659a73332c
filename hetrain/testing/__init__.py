"""Stand-ins for what cannot exist on one machine, for the tests, the demo and the emulated cluster:
a cloud's metadata endpoint (``fakecloud``) and spot nodes that go away at their deadline (``spot``).
"""
