"""Suite-wide: one engine secret for every process the tests start (engines, trainers, ranks), as
a launcher would hand it to both sides. Tests of refusals use other secrets explicitly."""

import os
import secrets

from delta_sync.auth import ENV

os.environ.setdefault(ENV, secrets.token_hex(32))
