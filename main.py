"""Command line: `python main.py --config=configs/cifar.py [--workdir=DIR] [--config.KEY=VALUE ...]`.

The same as `python -m jaxtrain ...` (jaxtrain/__main__.py), kept for a checkout.
"""
# Imported only when run as the command: a Grain worker process, which imports the main
# module again (multiprocessing's spawn), then imports only what reading data needs.
if __name__ == "__main__":
    from jaxtrain.__main__ import run

    run()
