import sys

from pycoll.cli import main

if __name__ == "__main__":  # spawned workers import this module by name too
    sys.exit(main())
