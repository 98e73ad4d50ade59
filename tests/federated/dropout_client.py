"""A client process that leaves mid-round, for the dropout test: ``python -m tests.federated.dropout_client
ROUND`` serves like ``python -m szo.federated.flower`` (its spec on stdin) but exits at once when
Flower round ROUND asks for its masked upload -- after it has shared its SecAgg+ keys, so the
server must rebuild its pairwise masks from the other clients' shares. Nothing of this lives in
the library."""
from __future__ import annotations

import json
import os
import sys

from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from szo.federated.flower import client_main


def leave_at(rnd: int):
    def mod(msg, context, call_next):
        cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS) if msg.has_content() else None
        if msg.metadata.group_id == str(rnd) and cfg is not None and cfg.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS:
            os._exit(0)
        return call_next(msg, context)

    return mod


if __name__ == "__main__":
    client_main(json.loads(sys.stdin.read()), mods=[leave_at(int(sys.argv[1]))])
