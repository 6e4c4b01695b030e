"""Command line: `python main.py --config=configs/cifar.py [--workdir=DIR] [--config.KEY=VALUE ...]`.

The same as `python -m jaxtrain ...` (jaxtrain/__main__.py), kept for a checkout.
"""
from jaxtrain.__main__ import run

if __name__ == "__main__":
    run()
