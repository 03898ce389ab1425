"""The latency distributions as a picture (matplotlib, imported only when --plot asks for it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL_HINT = "--plot needs matplotlib: .venv/bin/pip install matplotlib (it is not a dependency of mpsagent)"


def _ecdf(ax: Any, samples: list[float], label: str) -> None:
    ordered = sorted(samples)
    count = len(ordered)
    ax.step(ordered, [(i + 1) / count for i in range(count)], where="post", label=label)


def plot(doc: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
        from matplotlib.ticker import FuncFormatter  # noqa: PLC0415
    except ImportError as exc:
        raise SystemExit(INSTALL_HINT) from exc
    samples: dict[str, list[float]] = doc["samples_ms"]
    params = doc["params"]
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.5))
    _ecdf(left, samples["allocate_agent"], "agent")
    _ecdf(left, samples["allocate_floor"], "floor (grpclib, fixed answer)")
    left.set_xscale("log")
    left.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    left.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: f"{x:g}" if f"{x:g}"[0] in "25" else ""))
    left.set_xlabel("round trip (ms)")
    left.set_ylabel("fraction of calls")
    left.set_title(f"Allocate, 1 replica, {params['base']}")
    left.legend(loc="lower right")
    _ecdf(middle, samples["burst_agent"], "agent")
    _ecdf(middle, samples["burst_floor"], "floor")
    middle.set_xlabel("time to the last answer (ms)")
    middle.set_title(f"{params['burst_size']} concurrent Allocate calls")
    middle.legend(loc="lower right")
    names = ["full_grant", *(k for k in samples if k.startswith("preferred_") and not k.endswith("_floor"))]
    positions = [3 * i + offset for i in range(len(names)) for offset in (1, 2)]
    boxes = right.boxplot(
        [samples[f"{n}{suffix}"] for n in names for suffix in ("", "_floor")],
        positions=positions,
        whis=(1, 99),
        showfliers=False,
        patch_artist=True,
        medianprops={"color": "black"},
    )
    for index, box in enumerate(boxes["boxes"]):
        box.set_facecolor("tab:blue" if index % 2 == 0 else "tab:orange")
    labels = [n.replace("full_grant", "Allocate all").replace("preferred_", "preferred ") for n in names]
    right.set_xticks([3 * i + 1.5 for i in range(len(names))], labels)
    right.set_ylabel("round trip (ms), whiskers p1..p99")
    right.legend([boxes["boxes"][0], boxes["boxes"][1]], ["agent", "floor"], loc="upper left")
    right.set_title(f"At {params['scale']}")
    figure.suptitle(f"mpsagent, {doc['machine']['cpu_model']}, {doc['machine']['cpus']} CPUs ({doc['mode']} run)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
