"""Names that the control plane and the workers check alike."""

from __future__ import annotations

import re

# A LoRA adapter's name (LoadAdapter, GenerateRequest.adapter).
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ADAPTER_NAME_RULE = "must be 1 to 64 of A-Z a-z 0-9 . _ -"
