"""Command line for the data layer: `python -m jaxtrain.data download NAME [--dir DIR] [--mirror URL]`.

Fetches a built-in dataset ahead of time (e.g. before going offline) and
prints the directory it is in. Errors are one line on stderr and exit 1;
usage errors exit 2.
"""
from __future__ import annotations

import argparse
import sys

from jaxtrain.data.dataset import DataError
from jaxtrain.data.download import DEFAULT_CACHE_DIR, MIRROR_ENV_VAR, RESOURCES, download


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m jaxtrain.data',
                                     description='jaxtrain data utilities.')
    commands = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
    fetch = commands.add_parser('download', help='download a built-in dataset into the cache',
                                description='Download a built-in dataset and verify its checksums.')
    fetch.add_argument('name', metavar='NAME', help=f'one of: {", ".join(sorted(RESOURCES))}')
    fetch.add_argument('--dir', default=DEFAULT_CACHE_DIR,
                       help=f'cache directory to download into (default: {DEFAULT_CACHE_DIR})')
    fetch.add_argument('--mirror', default=None, metavar='URL',
                       help=f'URL base serving the cache layout, instead of the official sites '
                            f'(default: ${MIRROR_ENV_VAR})')
    fetch.add_argument('--quiet', '-q', action='store_true',
                       help='no progress bar (there is none when stderr is not a terminal)')
    args = parser.parse_args(argv)

    try:
        directory = download(args.name, args.dir, mirror=args.mirror,
                             progress=not args.quiet and sys.stderr.isatty())
    except DataError as e:
        print(f'error: {" ".join(str(e).split())}', file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print('error: interrupted', file=sys.stderr)
        return 130
    print(directory)
    return 0


if __name__ == '__main__':
    sys.exit(main())
