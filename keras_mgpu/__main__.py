"""`python -m keras_mgpu ...` runs the `keras-mgpu` command."""

import sys

from keras_mgpu.cli import main

if __name__ == "__main__":
    sys.exit(main())
