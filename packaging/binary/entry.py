"""PyInstaller's entry script for the one-file `mpsagent`: the same `main` as the `mpsagent` console script."""

from mpsagent.__main__ import main

if __name__ == "__main__":
    main()
