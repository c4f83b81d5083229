"""The three calls a server makes of a node, typed once: `FitCall`, `EvalCall`, `InitCall`.

The server builds a call once; it travels as one record of the Flower message (its JSON under
`RECORD`); the ClientApp forwards it to its lane's trainer service, which validates it (this
model is the service's request body) and hands it to the fit loop. Each key has one name from
the run config to the loop: `federation.local_epochs` in the recipe is `FitCall.local_epochs`
on the wire, in the service and in `RLTrainer.fit`.

Every call names the recipe the server resolved and the run's code (a node refuses to train
another recipe or to run other code: fl_app.provenance), the server's run dir and the token of
its shared-disk probe (a node that cannot read it cannot use the run dir as the weight store),
the weight store nodes open, and per member the global weights (`WeightsRef`: inline in the
message, or a manifest-pinned store entry).

This module holds no Flower type (fl_app imports no Flower): the Flower edge wraps a call as
`ConfigRecord({RECORD: call.model_dump_json()})`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from fl_app.channel import WeightsRef

RECORD = "call"  # the message's ConfigRecord (and its one key) holding a call's JSON

Count = Annotated[int, Field(ge=0, lt=2**31)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]


class Call(BaseModel):
    """What every call carries: which run, which round, what the run is, where its weights are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    run_id: int = 0  # the Flower run (a trainer service serves exactly one)
    round: Count = 0  # the federated round (0: the initial model)
    recipe_sha256: str = ""  # the recipe the server resolved (fl_app.config.recipe_sha256)
    recipe_leaves: dict[str, str] = Field(default_factory=dict)  # its per-key digests: a mismatch names the keys
    code_sha256: str = ""  # the run's code (fl_app.provenance)
    run_dir: str = ""  # the server's run dir
    run_dir_token: str = ""  # the token of its shared-disk probe (fl_app.channel.write_disk_probe)
    weight_store: str = ""  # the store nodes open ('' = the run dir; docs/weight-store.md)
    weight_store_token: str = ""  # the served store's credential for this call (fl_app/channel/credentials.py)
    weights: dict[str, WeightsRef] = Field(default_factory=dict)  # member -> the round's global weights
    # federation.update delta-int8 | delta-int4, a global model of round >= 1: member -> its compressed
    # step from the previous round's (fl_app.downlink), for a lane that holds that one
    steps: dict[str, WeightsRef] = Field(default_factory=dict)
    base_sha256: str = ""  # federation.update: lora: the frozen base the run's adapters add to (a node checks its own)


class FitCall(Call):
    """One client's local training in one round."""

    kind: Literal["fit"] = "fit"
    client_id: Count  # logical client id in [0, federation.clients)
    local_epochs: Annotated[int, Field(gt=0, le=10_000)]  # E: RL iterations (rollout batch + update)
    seed: Seed  # master seed; row seeds derive from (seed, round, client, epoch, index)
    proximal_mu: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0  # FedProx mu; policy only


class EvalCall(Call):
    """Validation of the round's global actor on the fixed validation set."""

    kind: Literal["evaluate"] = "evaluate"
    seed: Seed  # decoding seed (fixed across rounds)


class InitCall(Call):
    """Round 0: the lane exports its freshly built members (the server never loads a model)."""

    kind: Literal["init"] = "init"


AnyCall = FitCall | EvalCall | InitCall


class Reply(BaseModel):
    """A node's answer to a call, beside its metrics and the inline arrays of its weights."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: dict[str, WeightsRef] = Field(default_factory=dict)  # member -> what the node wrote (fit, init)
    client_id: int | None = None  # fit: the client it trained as (the server checks it is the one it asked)
    node_host: str = ""  # where the node's trainer service runs and logs (summary.json `nodes`)
    lane: str = ""  # the lane that served the call (`client_app.lane`), its device set, and the host's lanes
    devices: list[str] = Field(default_factory=list)
    host_lanes: list[str] = Field(default_factory=list)
    lane_span: tuple[float, float] | None = None  # fit: epoch seconds the lane started and ended it
    service_log: str = ""
    critic_start: dict[str, str] = Field(default_factory=dict)  # init: where the lane's critic came from (PPO)
    base_sha256: str = ""  # init under federation.update: lora: the digest of the lane's frozen base
