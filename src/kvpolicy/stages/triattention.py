"""TriAttention: keys scored by a trigonometric series of calibrated pre-RoPE query statistics
(arXiv 2604.04921; WeianMao/triattention), and its calibration file."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch
from pydantic import Field, PrivateAttr, model_validator

from ..files import replace_file
from .base import DataFile, EvictionInput, Scorer
from .fingerprint import FINGERPRINT_FORMAT, ModelFingerprint
from .model_facts import Fact, ModelFacts

#: The calibration format this kvpolicy reads and writes (``kvpolicy_calibration`` in the file).
CALIBRATION_FORMAT = 1
#: ``calibration: "builtin:NAME"`` reads a file shipped with kvpolicy (``kvpolicy/policies/calibration/NAME``).
CALIBRATION_FILE = DataFile("calibration")
resolve_calibration_path = CALIBRATION_FILE.resolve
_SHAPE_FIELDS = ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim")
_TENSORS = ("q_mean_real", "q_mean_imag", "q_abs_mean")


class CalibrationError(ValueError):
    """A query calibration file that cannot be used; the message names the file and the field."""


class CalibrationWarning(UserWarning):
    """A calibration file without the fingerprint of its model: which model it serves is then
    judged by the model's name alone (``QueryCalibration``)."""


class QueryCalibration:
    """Per (layer, query head) statistics of a model's pre-RoPE queries, measured offline
    (``kvpolicy calibrate``), in RoPE's frequency pairs: dimension ``f`` and ``f + D/2`` form the
    complex number ``q_f``.

    The file is safetensors: three float32 tensors ``[num_layers, num_attention_heads, D/2]``,
    ``q_mean_real`` and ``q_mean_imag`` (the mean ``E[q_f]``) and ``q_abs_mean`` (``E|q_f|``),
    and string metadata: ``kvpolicy_calibration`` (the format, ``1``), ``model`` (the model's
    name, the last part of ``ModelFacts.name``: for messages), ``num_layers``,
    ``num_attention_heads``, ``num_kv_heads``, ``head_dim`` (its shape), and the informative
    ``method``, ``text`` and ``tokens``. The model's fingerprint (``kvpolicy.stages.fingerprint``),
    which identifies it: metadata ``fingerprint`` (its format) and ``hidden_size``, float32
    tensors ``fingerprint_rope`` and ``fingerprint_o_proj``. A file without it (written before
    kvpolicy recorded one) is read with a ``CalibrationWarning``, and the model is then checked
    by name, as then.
    """

    def __init__(self, model: str, shape: dict[str, int], q_mean: torch.Tensor, q_abs_mean: torch.Tensor,
                 info: dict[str, str] | None = None, source: str = "<calibration>",
                 fingerprint: ModelFingerprint | None = None) -> None:
        self.model = model
        self.fingerprint = fingerprint
        self.shape = dict(shape)
        self.q_mean = q_mean  # [L, Hq, D/2] complex64
        self.q_abs_mean = q_abs_mean  # [L, Hq, D/2] float32
        self.info = dict(info or {})
        self.source = source
        self._check()

    def _check(self) -> None:
        for name in _SHAPE_FIELDS:
            value = self.shape.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CalibrationError(f"{self.source}: {name}: must be a positive int, got {value!r}")
        want = (self.shape["num_layers"], self.shape["num_attention_heads"], self.shape["head_dim"] // 2)
        for name, t in (("q_mean", self.q_mean), ("q_abs_mean", self.q_abs_mean)):
            if tuple(t.shape) != want:
                raise CalibrationError(
                    f"{self.source}: {name}: shape {tuple(t.shape)}, but the file declares [num_layers, "
                    f"num_attention_heads, head_dim / 2] = {want}"
                )
            if not bool(torch.isfinite(torch.view_as_real(t) if t.is_complex() else t).all()):
                raise CalibrationError(f"{self.source}: {name}: holds non-finite values")
        if bool((self.q_abs_mean < 0).any()):
            raise CalibrationError(f"{self.source}: q_abs_mean: holds negative values (it is a mean modulus)")
        fp = self.fingerprint
        if fp is not None:
            if fp.first_q_head or fp.o_proj.shape[1] != self.shape["num_attention_heads"]:
                raise CalibrationError(f"{self.source}: fingerprint_o_proj: must hold every query head's samples")
            for name in _SHAPE_FIELDS:
                if fp.named_shape[name] != self.shape[name]:
                    raise CalibrationError(f"{self.source}: fingerprint: {name} {fp.named_shape[name]}, but the file "
                                           f"declares {self.shape[name]}")

    def __eq__(self, other: object) -> bool:
        # The data only: where it was loaded from does not make it another calibration.
        if not isinstance(other, QueryCalibration):
            return NotImplemented
        return (self.model, self.shape) == (other.model, other.shape) and torch.equal(self.q_mean, other.q_mean) \
            and torch.equal(self.q_abs_mean, other.q_abs_mean)

    __hash__ = None  # type: ignore[assignment]  # mutable tensors

    @classmethod
    def measured(cls, facts: ModelFacts, q_mean: torch.Tensor, q_abs_mean: torch.Tensor, **info: str) -> QueryCalibration:
        """The calibration of the model ``facts`` describe, with its fingerprint (``CalibrationWarning``
        where the model cannot give one: the file is then checked by name)."""
        shape = {name: getattr(facts, name) for name in _SHAPE_FIELDS}
        fingerprint, why = facts.model_fingerprint()
        if fingerprint is None:
            warnings.warn(CalibrationWarning(
                f"the calibration of {facts.name!r} records no fingerprint of the model ({why or 'not given'}): "
                "a model is then judged to be the one it was measured on by its name alone"), stacklevel=2)
        # The name's last part: a calibration names the model, not the folder it was loaded from.
        return cls(Path(facts.name.rstrip("/")).name or facts.name, shape, q_mean.to(torch.complex64),
                   q_abs_mean.float(), info, fingerprint=fingerprint)

    def with_fingerprint(self, facts: ModelFacts) -> QueryCalibration:
        """This calibration with the fingerprint of the model ``facts`` describe, its statistics
        unchanged: for a file measured on that model before kvpolicy recorded fingerprints
        (``kvpolicy calibrate --add-fingerprint FILE``). Refuses a model of another shape, and a
        file that records another model's fingerprint already (that fingerprint is the file's own
        word); a file that records this model's is returned as it is. That a file without one was
        measured on this model is the caller's word."""
        self.check_model(facts, check_model=False)
        fingerprint, why = facts.model_fingerprint()
        if fingerprint is None:
            raise CalibrationError(f"the model {facts.name!r} gives no fingerprint: {why or 'not given'}")
        if self.fingerprint is not None:
            difference = self.fingerprint.difference(fingerprint)
            if difference is not None:  # replacing it would make the file serve a model it was not measured on
                raise CalibrationError(
                    f"calibration {self.source} already records the fingerprint of the model it was measured on, "
                    f"{self.model!r}; {facts.name!r} is another model ({difference}): measure one for it with "
                    "`kvpolicy calibrate`"
                )
            return self
        return QueryCalibration(self.model, self.shape, self.q_mean, self.q_abs_mean, self.info, self.source,
                                fingerprint=fingerprint)

    @classmethod
    def load(cls, path: str | Path) -> QueryCalibration:
        """Read a calibration file; ``CalibrationError`` naming the file and the field otherwise."""
        from safetensors import (
            SafetensorError,  # transformers' dependency, so always there
            safe_open,
        )
        from safetensors.torch import load_file

        source = str(path)
        try:
            is_file = Path(path).is_file()
        except (OSError, ValueError) as exc:  # a name too long for the OS, a NUL byte
            raise CalibrationError(f"no such calibration file: {source} ({exc.__class__.__name__})") from None
        if not is_file:
            raise CalibrationError(f"no such calibration file: {source} (measure one with `kvpolicy calibrate`)")
        try:
            with safe_open(source, framework="pt") as f:
                meta = dict(f.metadata() or {})
            tensors = load_file(source)
        except (SafetensorError, OSError, ValueError) as exc:
            raise CalibrationError(f"{source}: not a safetensors calibration file ({exc})") from None
        version = meta.get("kvpolicy_calibration")
        if version is None:
            raise CalibrationError(f"{source}: kvpolicy_calibration: missing (not a kvpolicy calibration file)")
        if version != str(CALIBRATION_FORMAT):
            raise CalibrationError(
                f"{source}: kvpolicy_calibration: format {version!r} is unknown; this kvpolicy reads {CALIBRATION_FORMAT}"
            )
        shape: dict[str, Any] = {}
        for name in _SHAPE_FIELDS:
            raw = meta.get(name)
            if raw is None or not raw.isdigit():
                raise CalibrationError(f"{source}: {name}: missing or not a positive int ({raw!r})")
            shape[name] = int(raw)
        for name in _TENSORS:
            if name not in tensors:
                raise CalibrationError(f"{source}: {name}: missing tensor")
            if tensors[name].dtype != torch.float32:
                raise CalibrationError(f"{source}: {name}: dtype {tensors[name].dtype}, expected float32")
        if tensors["q_mean_real"].shape != tensors["q_mean_imag"].shape:
            raise CalibrationError(f"{source}: q_mean_imag: shape differs from q_mean_real's")
        q_mean = torch.complex(tensors["q_mean_real"], tensors["q_mean_imag"])
        info = {k: v for k, v in meta.items() if k not in (*_SHAPE_FIELDS, *_FINGERPRINT_META, "kvpolicy_calibration", "model")}
        fingerprint = _read_fingerprint(source, meta, tensors, shape)
        calibration = cls(meta.get("model", ""), shape, q_mean, tensors["q_abs_mean"], info, source, fingerprint=fingerprint)
        if fingerprint is None:
            warnings.warn(CalibrationWarning(
                f"calibration {source} records no fingerprint of its model (written before kvpolicy recorded one): "
                f"the model it serves is judged by its name ({meta.get('model', '')!r}) alone; add it with `kvpolicy "
                "calibrate --model MODEL --add-fingerprint FILE -o OUT` on the model it was measured on"), stacklevel=2)
        return calibration

    def save(self, path: str | Path) -> None:
        """Write the file, replaced whole (``kvpolicy.files.replace_file``): a failed write is an
        ``OSError`` and leaves what was there."""
        from safetensors.torch import save

        meta = {"kvpolicy_calibration": str(CALIBRATION_FORMAT), "model": self.model,
                **{k: str(v) for k, v in self.shape.items()}, **self.info}
        tensors = {"q_mean_real": self.q_mean.real.contiguous(), "q_mean_imag": self.q_mean.imag.contiguous(),
                   "q_abs_mean": self.q_abs_mean.contiguous()}
        if self.fingerprint is not None:
            meta.update(fingerprint=str(FINGERPRINT_FORMAT), hidden_size=str(self.fingerprint.named_shape["hidden_size"]))
            tensors.update(fingerprint_rope=self.fingerprint.rope.contiguous(),
                           fingerprint_o_proj=self.fingerprint.o_proj.contiguous())
        replace_file(path, save(tensors, metadata=meta))

    def check_model(self, facts: ModelFacts, *, check_model: bool = True) -> None:
        """``CalibrationError`` unless the calibration was measured on the model ``facts`` describe:
        its shape always; with ``check_model``, the model itself, by its fingerprint where the file
        records one (by name where it does not). Facts that do not know the fingerprint yet (a
        configuration alone: vLLM's front end) pass on the shape; facts of a model that cannot give
        one (no RoPE or output projection) are refused: the model measured gave one."""
        for name in _SHAPE_FIELDS:
            if self.shape[name] != getattr(facts, name):
                raise CalibrationError(
                    f"calibration {self.source}: {name} = {self.shape[name]}, but the model {facts.name!r} has "
                    f"{getattr(facts, name)}: measure one for this model with `kvpolicy calibrate`"
                )
        if not check_model:
            return
        escape = "measure one for this model with `kvpolicy calibrate` (or set check_model: false to use it anyway)"
        if self.fingerprint is None:
            if _base_name(self.model) != _base_name(facts.name):
                raise CalibrationError(
                    f"calibration {self.source}: model = {self.model!r}, but the cache serves {facts.name!r} (the file "
                    f"records no fingerprint, so the name decides): {escape}"
                )
            return
        live, why = facts.model_fingerprint()
        if live is None and why is None:
            return  # not known yet: checked where the weights are loaded
        difference = why if live is None else self.fingerprint.difference(live)
        if difference is not None:
            raise CalibrationError(
                f"calibration {self.source} was measured on the model {self.model!r}, but the cache serves "
                f"{facts.name!r}, another model: {difference}; {escape}"
            )


def _base_name(name: str) -> str:
    return Path(name.rstrip("/")).name.lower()


_FINGERPRINT_META = ("fingerprint", "hidden_size")


def _read_fingerprint(source: str, meta: dict[str, str], tensors: dict[str, torch.Tensor],
                      shape: dict[str, int]) -> ModelFingerprint | None:
    """The fingerprint a calibration file records (None: none, an older file)."""
    version = meta.get("fingerprint")
    if version is None:
        return None
    if version != str(FINGERPRINT_FORMAT):
        raise CalibrationError(f"{source}: fingerprint: format {version!r} is unknown; this kvpolicy reads "
                               f"{FINGERPRINT_FORMAT} (measure the calibration again with `kvpolicy calibrate`)")
    hidden = meta.get("hidden_size")
    if hidden is None or not hidden.isdigit():
        raise CalibrationError(f"{source}: hidden_size: missing or not a positive int ({hidden!r})")
    for name in ("fingerprint_rope", "fingerprint_o_proj"):
        if name not in tensors:
            raise CalibrationError(f"{source}: {name}: missing tensor (the file declares a fingerprint)")
    try:
        return ModelFingerprint((*(shape[n] for n in _SHAPE_FIELDS), int(hidden)), tensors["fingerprint_rope"],
                                tensors["fingerprint_o_proj"])
    except ValueError as exc:
        raise CalibrationError(f"{source}: {exc}") from None


def geometric_offsets(largest: int) -> list[int]:
    """``1, 2, 4, ...`` up to ``largest``: the future distances the score is averaged over."""
    return [1 << i for i in range(int(math.log2(largest)) + 1)]


class TriAttentionScorer(Scorer):
    """Each key's expected logit under the calibrated queries, averaged over future distances.

    Per query head ``h`` with calibrated pre-RoPE statistics ``E[q_f]`` and ``E|q_f|`` (``f`` a
    RoPE frequency pair), post-RoPE key ``k`` at position ``p``, and ``t0`` the next position
    (the newest slot's plus one), the score of the key is the mean over ``delta`` in
    ``geometric_offsets(offset_max)`` of
    ``sum_f s_f^2 |E q_f| |k_f| cos(w_f (t0 + delta - p) + phi_f) + sum_f s_f^2 (E|q_f| - |E q_f|) |k_f|``
    (``k_f`` pre-RoPE, ``phi_f = arg E q_f - arg k_f``, ``s_f`` the RoPE attention scaling): the
    first sum is the mean query's logit at the future position, the second what the queries'
    spread around it can add. Computed on the post-RoPE key, whose rotation by ``p`` the
    model's RoPE at ``t0 + delta`` completes (``ModelFacts.rope``). Then, with ``normalize``,
    a z-score over each query head's valid candidates, and ``group_reduce`` over the ``G`` query
    heads of the KV head.
    """

    type_name: ClassVar[str] = "triattention"
    reads_values: ClassVar[bool] = False
    needs_model: ClassVar[frozenset[Fact]] = frozenset({"rope"})

    calibration: Annotated[str, CALIBRATION_FILE] = Field(..., min_length=1, description='The query calibration file (see `kvpolicy calibrate`), or "builtin:NAME".')
    offset_max: int = Field(65536, ge=1, le=1 << 24, description="The largest future distance (offsets 1, 2, 4, ... up to it).")
    normalize: bool = Field(True, description="z-score each query head's scores over its candidates before reducing.")
    group_reduce: Literal["max", "mean"] = Field("max", description="Over the query heads of a KV head.")
    trig: bool = Field(True, description="Keep the position-dependent (cosine) term; false: the authors' disable_trig.")
    mean_length_residual: bool = Field(
        True, description="The second term weighs E|q| - |E q| (true) or E|q| (false: the authors' disable_mlr).")
    check_model: bool = Field(
        True, description="Refuse a calibration measured on another model (by its fingerprint; by name where the "
        "file records none). check_name, its former name, is read as it, with a FutureWarning.")
    _calibration: Any = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and "check_name" in data:
            data = dict(data)
            value = data.pop("check_name")
            if "check_model" in data:
                raise ValueError("check_name: the former name of check_model; give check_model alone")
            warnings.warn(FutureWarning(
                "triattention: check_name is now check_model (the model is identified by its fingerprint, not its "
                "name); check_name will be refused in a later kvpolicy"), stacklevel=2)
            data["check_model"] = value
        return data

    @model_validator(mode="after")
    def _load(self) -> TriAttentionScorer:
        try:
            self._calibration = QueryCalibration.load(CALIBRATION_FILE.resolve(self.calibration, "calibration"))
        except CalibrationError as exc:
            raise ValueError(f"calibration: {exc}") from None
        return self

    @property
    def may_be_negative(self) -> bool:
        return True

    def check_model_facts(self, facts: ModelFacts) -> None:
        self._calibration.check_model(facts, check_model=self.check_model)

    def score(self, inp: EvictionInput) -> torch.Tensor:
        facts = inp.facts(self)
        b, hkv, n, d = inp.keys.shape
        g, half, device = inp.group_size, d // 2, inp.keys.device
        cal = self._calibration
        first = inp.head_offset * g
        layers = inp.layer_index.to(cal.q_mean.device)
        q_mean = cal.q_mean[layers, first : first + hkv * g].to(device).view(b, hkv, g, half)
        q_abs = cal.q_abs_mean[layers, first : first + hkv * g].to(device).view(b, hkv, g, half)
        keys = inp.keys.float()
        k_re, k_im = keys[..., :half], keys[..., half:]
        newest = inp.positions.masked_fill(~inp.slot_valid, -1).flatten(1).amax(-1).clamp_min(0)  # [B]
        offsets = torch.tensor(geometric_offsets(self.offset_max), device=device)
        cos, sin = facts.rope(newest[:, None] + 1 + offsets)  # [B, O, D]: s_f e^{i w_f (t0 + delta)}
        scale = facts.rope(torch.zeros(1, dtype=torch.long, device=device))
        s_f = (scale[0][0, :half] ** 2 + scale[1][0, :half] ** 2).sqrt()  # [D/2]
        score = torch.zeros(b, hkv, g, n, dtype=torch.float32, device=device)
        if self.trig:
            e_re, e_im = cos[..., :half].mean(1), sin[..., :half].mean(1)  # [B, D/2]
            e_re, e_im = e_re[:, None, None], e_im[:, None, None]
            # Re(E q_f * conj(k_f) * E_f), summed over f: the cosine series on post-RoPE keys.
            a = q_mean.real * e_re - q_mean.imag * e_im
            c = q_mean.imag * e_re + q_mean.real * e_im
            score += torch.einsum("bhgf,bhnf->bhgn", a, k_re) + torch.einsum("bhgf,bhnf->bhgn", c, k_im)
        spread = q_abs - q_mean.abs() if self.mean_length_residual else q_abs
        k_mod = (k_re * k_re + k_im * k_im).sqrt()  # s_f |k_f| of the pre-RoPE key
        score += torch.einsum("bhgf,bhnf->bhgn", spread * s_f, k_mod)
        cand = inp.candidate_mask[:, :, None]  # [B, Hkv, 1, N]
        if self.normalize:
            count = cand.sum(-1, keepdim=True).clamp_min(1)
            mean = (score * cand).sum(-1, keepdim=True) / count
            std = ((((score - mean) * cand) ** 2).sum(-1, keepdim=True) / count).sqrt().clamp_min(1e-6)
            score = (score - mean) / std
        reduced = score.amax(2) if self.group_reduce == "max" else score.mean(2)
        return reduced.masked_fill(~inp.candidate_mask, 0.0)
