"""Server optimizers: the step from the round's global model along the clients' mean, with state.

The aggregation (fl_app.aggregate, or whatever aggregator the recipe picks) writes the clients'
mean `avg` of a member; the step then streams the round's global model `w`, `avg` and the
optimizer's moments of the previous round shard by shard and piece by piece, in lock step, and
writes the new global model and the new moments (`federation.server_optimizer`). Per element,
in fp32, with Delta = avg - w the pseudo-gradient (FedOpt's) and eta = `federation.server_lr`:

    fedavgm   m' = beta m + Delta;                     w' = w + eta m'
              (server momentum: Hsu et al. 2019, arXiv 1909.06335; FedOpt's FedAvgM)
    fedadam   m' = b1 m + (1 - b1) Delta
              v' = b2 v + (1 - b2) (Delta Delta);       w' = w + eta (m' / (sqrt(v') + tau))
              (FedOpt: Reddi et al. 2021, arXiv 2003.00295, Algorithm 2: no bias correction)
    nesterov  g = w - avg (DiLoCo's outer gradient); m' = mu m + g
              w' = w - eta (g + mu m')
              (DiLoCo: Douillard et al. 2023, arXiv 2311.08105: SGD with Nesterov momentum, as
              torch.optim.SGD(nesterov=True, dampening=0) steps)

`sgd` (w + eta Delta) has no state and is not computed here: it is the aggregation's own fold
(`fl_app.aggregate.server_step_factors`), bit for bit what it always was.

Each product and sum above is one fp32 operation, rounded once, in the order written (no fused
multiply-add), so the bits do not depend on how the tensors are cut into pieces: a plain torch
computation on whole tensors in the same order gives the same bits (the tests compare them).
The moments start at zero: round 0 stores none, and round 1's step reads zeros. Every round
r >= 1 stores its moments as fp32 shards with the member's own layout, one weights dir per
moment (rounds/round-R/server_opt/<optimizer>/<member>/<moment>, `fl_app.rundir`), hashed like
any weights and recorded in the round's COMPLETE marker, so resuming after round R continues from
exactly round R's moments. Non-floating buffers are no optimizer's business: the new global model
takes the clients' (avg's) values and the moments hold zeros in their place. Memory stays at a few
pieces per input and output; a non-finite result (fp32 overflow: every input was checked finite
when it was written) writes nothing.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fl_app.aggregate import PIECE_BYTES, PREVIOUS, stream_manifests
from fl_app.config import FederationCfg, resolved
from fl_app.rundir import RunDir
from fl_app.weights import Manifest, TensorInfo, WeightsError, all_finite, same_layout

MOMENTS: dict[str, tuple[str, ...]] = {"fedavgm": ("m",), "fedadam": ("m", "v"), "nesterov": ("m",)}


@dataclass(frozen=True)
class ServerOptimizer:
    """A stateful server optimizer (`federation.server_optimizer` other than sgd) and its knobs."""

    name: str
    lr: float
    momentum: float = 0.0  # fedavgm's beta, nesterov's mu
    beta1: float = 0.0
    beta2: float = 0.0
    tau: float = 0.0

    @classmethod
    def from_config(cls, fed: FederationCfg) -> ServerOptimizer | None:
        """The recipe's optimizer; None for `sgd`, the stateless fold of the aggregation itself."""
        if fed.server_optimizer == "sgd":
            return None
        knobs = {
            "momentum": fed.server_momentum,
            "beta1": fed.server_beta1,
            "beta2": fed.server_beta2,
            "tau": fed.server_tau,
        }
        lr = resolved(fed.server_lr, "federation.server_lr")
        return cls(fed.server_optimizer, lr, **{k: float(v) for k, v in knobs.items() if v is not None})

    @property
    def moments(self) -> tuple[str, ...]:
        return MOMENTS[self.name]

    def entries(self, member: str) -> list[str]:
        """The state entries of `member` (paths below a round's server_opt dir), one per moment."""
        return [f"{self.name}/{member}/{m}" for m in self.moments]

    def state_entries(self, members: Sequence[str]) -> tuple[str, ...]:
        """Every state entry a round r >= 1 holds (what its COMPLETE marker must record)."""
        return tuple(e for member in members for e in self.entries(member))

    def step_round(self, rd: RunDir, r: int) -> dict[str, Manifest]:
        """Round r's step of every member of `rd`: from round r - 1's global model along the
        clients' mean the aggregation wrote into `rd.mean_dir(r, member)` (removed once every
        member is stepped), with round r - 1's moments (zeros when r = 1) into round r's.
        Returns the new manifests."""
        out = {}
        for m in rd.members:
            state_in = [rd.opt_state_dir(r - 1, e) for e in self.entries(m)] if r > 1 else None
            state_out = [rd.opt_state_dir(r, e) for e in self.entries(m)]
            out[m] = self.step(rd.member_dir(r - 1, m), rd.mean_dir(r, m), state_in, rd.member_dir(r, m), state_out, m)
        shutil.rmtree(rd.mean_dir(r, rd.members[0]).parent)
        return out

    def step(
        self,
        previous: Path,
        mean: Path,
        state_in: Sequence[Path] | None,
        out_dir: Path,
        state_out: Sequence[Path],
        member: str = "actor",
    ) -> Manifest:
        """Write the new global model into `out_dir` and the new moments into `state_out` (fresh
        dirs, one per moment) from the round's global model `previous`, the clients' mean `mean`
        and the previous moments `state_in` (None: zeros, before round 1). All inputs are read
        against their digests; on any error nothing stays in the outputs."""
        if len(state_out) != len(self.moments) or (state_in is not None and len(state_in) != len(self.moments)):
            raise WeightsError(f"{self.name} keeps moments {list(self.moments)}: pass one dir per moment")
        w, avg = Manifest.from_dir(previous), Manifest.from_dir(mean)
        moments = [Manifest.from_dir(p) for p in state_in] if state_in is not None else []
        _check_inputs(w, avg, moments, member)
        inputs, labels = [w, avg, *moments], [PREVIOUS, MEAN, *(f"moment {m}" for m in self.moments)]
        size = max([min(PIECE_BYTES, t.nbytes) for t in w.tensors] or [0]) // 4
        scratch = [torch.empty(size, dtype=torch.float32) for _ in range(2)]
        zeros = torch.zeros(size, dtype=torch.float32)

        def combine(info: TensorInfo, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
            new_w, new_state = outs[0], outs[1:]
            if not info.torch_dtype.is_floating_point:
                new_w.copy_(ins[1])
                for o in new_state:
                    o.zero_()
                return
            n = new_w.numel()
            state = ins[2:] or [zeros[:n]] * len(self.moments)
            self.apply(ins[0], ins[1], state, new_w, new_state, [t[:n] for t in scratch])
            if not all(all_finite(t) for t in outs):
                raise WeightsError(
                    f"the {self.name} server step overflowed fp32 in {member} tensor {info.name!r} (every input "
                    "is finite); nothing was written. Lower federation.server_lr, or find why the clients' mean "
                    "moved so far (a diverged training)"
                )

        outs = stream_manifests(list(enumerate(inputs)), labels, combine, [out_dir, *state_out], w.max_shard_bytes)
        return outs[0]

    def apply(
        self,
        w: torch.Tensor,
        avg: torch.Tensor,
        state: Sequence[torch.Tensor],
        new_w: torch.Tensor,
        new_state: Sequence[torch.Tensor],
        scratch: Sequence[torch.Tensor],
    ) -> None:
        """One piece of the step (module doc): fills `new_w` and `new_state` (outputs distinct from
        the inputs) using `scratch`, two fp32 buffers of the piece's size. One rounding per op."""
        t, u = scratch
        if self.name == "fedavgm":
            (m,), (m2,) = state, new_state
            torch.sub(avg, w, out=t)  # Delta
            torch.mul(m, self.momentum, out=m2).add_(t)
            torch.mul(m2, self.lr, out=u)
            torch.add(w, u, out=new_w)
        elif self.name == "fedadam":
            (m, v), (m2, v2) = state, new_state
            torch.sub(avg, w, out=t)  # Delta
            torch.mul(t, 1 - self.beta1, out=u)
            torch.mul(m, self.beta1, out=m2).add_(u)
            torch.mul(t, t, out=u).mul_(1 - self.beta2)
            torch.mul(v, self.beta2, out=v2).add_(u)
            torch.sqrt(v2, out=u).add_(self.tau)
            torch.div(m2, u, out=u).mul_(self.lr)
            torch.add(w, u, out=new_w)
        elif self.name == "nesterov":
            (m,), (m2,) = state, new_state
            torch.sub(w, avg, out=t)  # g, DiLoCo's outer gradient
            torch.mul(m, self.momentum, out=m2).add_(t)
            torch.mul(m2, self.momentum, out=u).add_(t)
            u.mul_(self.lr)
            torch.sub(w, u, out=new_w)
        else:
            raise WeightsError(f"unknown server optimizer {self.name!r}; use one of {sorted(MOMENTS)}")


MEAN = "the clients' mean"  # the step's second input's label in errors (the first is PREVIOUS)


def _check_inputs(w: Manifest, avg: Manifest, moments: Sequence[Manifest], member: str) -> None:
    """The step walks its inputs in lock step: the same tensors in the same shards (the walker
    checks they are fp32)."""
    if not same_layout([w, avg]) or w.max_shard_bytes != avg.max_shard_bytes:
        raise WeightsError(
            f"{PREVIOUS} ({w.root}) and {MEAN} ({avg.root}) of {member} lay their tensors or shards out "
            "differently (was run.shard_max_mb changed on resume?); the server optimizer steps from one "
            "along the other, so they must match: keep the run's shard size"
        )
    for m in moments:
        if not same_layout([w, m]):
            raise WeightsError(
                f"server optimizer state {m.root} does not lay its tensors out as {PREVIOUS} ({w.root}) of "
                f"{member}; it belongs to another model or shard size: resume with the run's own model and "
                "run.shard_max_mb, or use a new run dir"
            )
