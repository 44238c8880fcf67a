"""Check a training config without GPUs: the rank layout, every pipeline stage built on the meta device (no
memory) and TP-sharded, the batch arithmetic over the whole ramp-up, and the planner's memory per GPU.

    mtnlg-dry-run --config configs/mtnlg_530b.yaml [--config more.yaml ...] [--gpu a100-80g]
"""

import argparse
import sys

from mtnlg_lightning.errors import run_main
from mtnlg_lightning.gpus import gpu_names
from mtnlg_lightning.planning.dry_run import dry_run
from mtnlg_lightning.shipped_configs import config_argument


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="mtnlg-dry-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--config",
        type=config_argument(),
        action="append",
        required=True,
        help="a `mtnlg fit` YAML config; repeat to merge several, later ones win (as the CLI)",
    )
    parser.add_argument(
        "--gpu",
        default="a100-80g",
        choices=gpu_names(),
        help="GPU type for the memory check (default a100-80g, MT-NLG's DGX A100)",
    )
    parser.add_argument(
        "--recompute",
        default=None,
        choices=("none", "selective", "full"),
        help="activation recompute for the memory estimate (default: the config's model.activation_checkpointing "
        "or ActivationCheckpointing callback, else none)",
    )
    args = parser.parse_args(argv)

    def body() -> int:
        report = dry_run(args.config, args.gpu, args.recompute)
        print(report)
        return 0

    return run_main("mtnlg-dry-run", body)


if __name__ == "__main__":
    sys.exit(main())
