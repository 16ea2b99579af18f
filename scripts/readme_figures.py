"""Copy one stored figure of each notebook to docs/figures/NN.png for the README's table of contents.

    .venv/bin/python scripts/readme_figures.py      # after `make notebooks`

Which figure: the first PNG output of the code cell whose source contains the marker below.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKERS = {
    "00_setup_check": "plots.machine",
    "01_processes_and_ranks": "plots.dp_vs_ddp",
    "02_collectives": "dist.all_reduce(x, op=SUM)",
    "03_ring_allreduce": "plots.ring_step",
    "04_ddp": "plots.ddp_timeline(bucketed)",
    "05_fsdp": "plots.memory_bars",
    "06_ddp_vs_fsdp": "plots.guide_grid",
    "07_torchrun": "rendezvous=\"static\"",
    "08_pitfalls": "",
    "09_tensor_parallel": "The block's weights on 2 ranks",
    "10_pipeline_parallel": "for name, reports in runs.items():\n    spans",
    "11_fsdp_tp_2d": "A 2 x 2 mesh",
    "12_context_parallel": "each step's computing and waiting",
    "13_expert_parallel": "plots.dispatch(sent)",
    "14_cluster_simulated": "3 simulations of a 7B step",
    "15_step_through_every_rank": "plots.collective_order",
    "16_when_a_rank_dies": "plots.restart_timeline",
}


def main() -> None:
    out = ROOT / "docs" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    for stem, marker in MARKERS.items():
        notebook = json.loads((ROOT / "notebooks" / f"{stem}.ipynb").read_text())
        for cell in notebook["cells"]:
            if cell["cell_type"] != "code" or marker not in "".join(cell["source"]):
                continue
            pngs = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
            if pngs:
                (out / f"{stem[:2]}.png").write_bytes(base64.b64decode(pngs[0]))
                print(f"{stem}: docs/figures/{stem[:2]}.png")
                break
        else:
            print(f"{stem}: no figure found for {marker!r}")


if __name__ == "__main__":
    main()
