"""`python -m cute_attn <info|check|bench|compile>`: see cute_attn.cli for the commands."""

import sys

from cute_attn.cli import main

sys.exit(main())
