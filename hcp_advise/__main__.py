"""``python -m hcp_advise``: print the advice (arguments: ``--help``)."""

import sys

from hcp_compile.validation import InputError

from .command import main

try:
    print(main())
except InputError as error:
    sys.exit(f"error: {error}")
