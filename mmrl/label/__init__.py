"""`mmrl label`: a local web page where a person compares a prompt's samples side by side and picks the better one;
the choices become preference pairs in the Pick-a-Pic columns the Diffusion-DPO recipe reads (docs/labeling.md).

- `mmrl.label.pairs`: the queue (samples grouped by prompt, items with content-hash ids);
- `mmrl.label.store`: the append-only event log and the preference file rebuilt from it;
- `mmrl.label.server`: the page and its JSON API (leases so two tabs never get one item);
- `mmrl.label.cli`: the command.
"""

from mmrl.label.pairs import Item, build_queue
from mmrl.label.server import LabelServer
from mmrl.label.store import LabelStore

__all__ = ["Item", "build_queue", "LabelServer", "LabelStore"]
