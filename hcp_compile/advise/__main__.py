"""``python -m hcp_compile.advise``: print the advice (arguments: ``--help``)."""

import sys

from ..validation import InputError
from .command import main

try:
    print(main())
except InputError as error:
    sys.exit(f"error: {error}")
