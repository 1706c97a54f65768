"""What a build is sized for: a choice of `plan`, `build` and `matrix` (`--workload`) from
which the planner derives the limits per card and checkpoint (plan.py, docs/build.md
"Workloads")."""

from __future__ import annotations

from .typed_config import OptionChoice


class Workload(OptionChoice):
    # The profile's limits: images and short clips at the card's full batch.
    CHAT = "chat"
    # The checkpoint's whole video budget in one request (a 30-frame 1280x720 clip at the
    # size its own processor gives it), the batch lowered where the prompt table costs.
    VIDEO = "video"
    # 256K context where the KV cache holds one such sequence beside the batch, else 128K
    # (chunked context; the MRoPE table sized to it).
    LONG = "long"

    @classmethod
    def option(cls) -> str:
        return "--workload"
