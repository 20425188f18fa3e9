"""The bandit's run as a PNG: cumulative pulls per arm and each arm's running mean reward over steps."""
from __future__ import annotations

from pathlib import Path


def plot_bandit(policy, path: str | Path, title: str | None = None) -> Path:
    """Left: cumulative pulls of each arm against the step; right: its running mean reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    k = len(policy.arms)
    pulls, sums = [0] * k, [0.0] * k
    xs: list[list[int]] = [[] for _ in range(k)]
    counts: list[list[int]] = [[] for _ in range(k)]
    means: list[list[float]] = [[] for _ in range(k)]
    for step, arm, _tokens, r in policy.history:
        pulls[arm] += 1
        sums[arm] += r
        xs[arm].append(step)
        counts[arm].append(pulls[arm])
        means[arm].append(sums[arm] / pulls[arm])
    for arm in range(k):
        label = policy.arms[arm].spec()
        ax.step(xs[arm], counts[arm], where="post", label=label)
        ax2.plot(xs[arm], means[arm], label=label)
    ax.set_xlabel("decoding step")
    ax.set_ylabel("pulls")
    ax.set_title("cumulative pulls per arm")
    ax2.set_xlabel("decoding step")
    ax2.set_ylabel("mean reward -(1 + lambda_gamma g) / tokens")
    ax2.set_title("running mean reward per arm")
    for a in (ax, ax2):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title or f"UCB tree bandit: lambda_ucb {policy.lambda_ucb:g}, lambda_gamma {policy.lambda_gamma:.4f}, "
                 f"{policy.rounds} steps", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
