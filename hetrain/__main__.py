from hetrain.cli import main

main()
