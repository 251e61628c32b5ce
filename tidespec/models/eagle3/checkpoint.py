"""EAGLE-3 checkpoints in the vLLM / SGLang layout, and a versioned, atomically published drafter area.

Why this exists: the trainer process (TIDE Sec. 3.3) hands new drafter weights to the serving
engine through a directory, and the same files should load in vLLM / SGLang unchanged. A reader
(the engine polling for a newer drafter) must never see a half-written checkpoint.

Layout of one checkpoint directory (names as vLLM's ``llama_eagle3.py`` loads them)::

    config.json          {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                          "hidden_size": H, "num_hidden_layers": 1, "vocab_size": V,
                          "draft_vocab_size": Vd, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [...]}, ...}
    model.safetensors    fc.weight [H, 3H]
                         midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight [H]
                         midlayer.self_attn.q_proj.weight [n_h*hd, 2H]  (k_proj, v_proj: [n_kv*hd, 2H])
                         midlayer.self_attn.o_proj.weight [H, n_h*hd]
                         midlayer.mlp.{gate,up}_proj.weight [I, H], midlayer.mlp.down_proj.weight [H, I]
                         norm.weight [H], lm_head.weight [Vd, H]
                         d2t [Vd] int64 (target_id = draft_id + d2t[draft_id]), t2d [V] bool
                         embed_tokens.weight [V, H]  (optional; vLLM takes the target's otherwise)
    deeper heads (Dovetail): "num_hidden_layers": N and layers.{1..N-1}.* plain decoder layers
    gated fusion (Dovetail's DGF, ours; vLLM / SGLang do not load it): "tidespec_fusion": "gated",
                         midlayer.gated.{embed_norm,embed_proj,gate}.weight, q/k/v read [.., H],
                         no midlayer.input_layernorm

Publish area::

    root/
      v1/ v2/ ...        complete checkpoints (+ metrics.json), each renamed into place whole
      LATEST             "2\\n", replaced atomically after the rename
      .tmp-v3-<uuid>/    a write in progress (or a crashed one): never read

Worked example::

    n = publish(root, head, {"accept_len": 2.7})   # -> 1, then 2, ...
    latest_version(root)                            # -> n
    pub = load_version(root, n)                     # PublishedDrafter(version, config, state_dict, metrics)
    drafter.load_state(pub.version, pub.state_dict, pub.config)
"""

from __future__ import annotations

import fcntl
import json
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tidespec.errors import UserError
from tidespec.files import METRICS_NAME, fsync_path, latest_version, list_versions, publish_version, write_synced
from tidespec.models.eagle3.head import Eagle3Config, Eagle3ConfigError, Eagle3Head
from tidespec.models.target import TargetConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
SEED_LOCK_NAME = ".seed.lock"  # held while a root's first version is seeded (``seed_root``)
FRESH_HEAD_SEED = 0  # engine and trainer build the same random head when nothing was published
BOOTSTRAP_DRAFTER = "eagle3-smollm2-135m-instruct"  # the embedded model's head, a directory under tidespec/assets

logger = logging.getLogger(__name__)


def shipped_bootstrap() -> Path | None:
    """The bootstrap EAGLE-3 drafter shipped for the embedded model (SmolLM2-135M-Instruct), if installed."""
    path = Path(str(resources.files("tidespec") / "assets" / BOOTSTRAP_DRAFTER))
    return path if (path / CONFIG_NAME).is_file() else None


class DrafterCheckpointError(UserError, ValueError):
    """A drafter checkpoint directory is missing, malformed or does not fit the target (one line)."""


def shipped_head_for(target_cfg: TargetConfig) -> Path | None:
    """The shipped bootstrap head when its config fits ``target_cfg`` (the embedded
    SmolLM2-135M-Instruct's width, vocabulary and layers), else None. Reads the config only: the
    drafter that loads the head validates its tensors (``load_drafter_source``).

    Example: the embedded model's config -> ``.../tidespec/assets/eagle3-smollm2-135m-instruct``;
    a tiny random Llama's -> None."""
    boot = shipped_bootstrap()
    if boot is None:
        return None
    try:
        _check_fit(config_from_hf(_read_config(boot), target_cfg), target_cfg)
    except (DrafterCheckpointError, Eagle3ConfigError):
        return None
    return boot


@dataclass
class PublishedDrafter:
    version: int
    config: Eagle3Config
    state_dict: dict[str, torch.Tensor]  # Eagle3Head.state_dict() names
    metrics: dict[str, Any]


# ----------------------------------------------------------------------------------------------
# config and tensor names
# ----------------------------------------------------------------------------------------------


def config_to_hf(cfg: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` dict vLLM / SGLang read for an EAGLE-3 Llama draft."""
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.target_vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.tap_layers), "use_aux_hidden_state": True},
    }
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.fusion != "concat":
        out["tidespec_fusion"] = cfg.fusion
    return out


def config_from_hf(d: dict[str, Any], target_cfg: TargetConfig | None = None) -> Eagle3Config:
    """Parse an EAGLE-3 ``config.json``; tap layers default to the target's EAGLE-3 layers."""
    try:
        archs = d.get("architectures") or []
        if ARCHITECTURE not in archs:
            raise DrafterCheckpointError(f"architectures {archs} does not name {ARCHITECTURE}")
        if int(d.get("num_hidden_layers", 1)) < 1:
            raise DrafterCheckpointError(f"num_hidden_layers must be >= 1, got {d.get('num_hidden_layers')}")
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        taps = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if taps is None:
            if target_cfg is None:
                raise DrafterCheckpointError("config has no eagle_aux_hidden_state_layer_ids and no target was given")
            taps = Eagle3Config.for_target(target_cfg).tap_layers
        vocab = int(d["vocab_size"])
        return Eagle3Config(
            hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            intermediate_size=int(d["intermediate_size"]),
            target_vocab_size=vocab,
            draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
            tap_layers=tuple(int(t) for t in taps),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rope_scaling=d.get("rope_scaling"),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            num_layers=int(d.get("num_hidden_layers", 1)),
            fusion=str(d.get("tidespec_fusion", "concat")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, DrafterCheckpointError):
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DrafterCheckpointError(f"bad EAGLE-3 config.json: {reason}") from None


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape (``embed_tokens.weight`` excluded: it is optional)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    width = h if cfg.fusion == "gated" else 2 * h
    out: dict[str, tuple[int, ...]] = {"fc.weight": (h, cfg.tap_size)}
    for i in range(cfg.num_layers):
        m = "midlayer." if i == 0 else f"layers.{i}."
        inp = width if i == 0 else h
        out.update({
            m + "self_attn.q_proj.weight": (q, inp),
            m + "self_attn.k_proj.weight": (kv, inp),
            m + "self_attn.v_proj.weight": (kv, inp),
            m + "self_attn.o_proj.weight": (h, q),
            m + "post_attention_layernorm.weight": (h,),
            m + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            m + "mlp.up_proj.weight": (cfg.intermediate_size, h),
            m + "mlp.down_proj.weight": (h, cfg.intermediate_size),
        })
        out[m + ("hidden_norm.weight" if i == 0 else "input_layernorm.weight")] = (h,)
    if cfg.fusion == "gated":
        out.update({"midlayer.gated.embed_norm.weight": (h,), "midlayer.gated.embed_proj.weight": (h, h),
                    "midlayer.gated.gate.weight": (h, 2 * h)})
    else:
        out["midlayer.input_layernorm.weight"] = (h,)
    out.update({"norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h), "d2t": (cfg.draft_vocab_size,),
                "t2d": (cfg.target_vocab_size,)})
    return out


_BLOCK = re.compile(r"^blocks\.(\d+)\.")
_LAYER = re.compile(r"^layers\.(\d+)\.")


def head_to_checkpoint(cfg: Eagle3Config, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Eagle3Head.state_dict()`` -> checkpoint tensors (q|k|v and gate|up split, ``blocks.j.`` as
    ``layers.{j+1}.``, contiguous copies)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        t = t.detach()
        name = _BLOCK.sub(lambda mt: f"layers.{int(mt.group(1)) + 1}.", name)
        if name.endswith("self_attn.qkv_proj.weight"):
            for part, piece in zip(("q", "k", "v"), t.split([q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", f"{part}_proj")] = piece.contiguous().clone()
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = t.split(cfg.intermediate_size, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous().clone()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous().clone()
        else:
            out[name] = t.contiguous().clone()
    return out


def _head_name(name: str) -> str:
    """Checkpoint name -> head name: ``layers.0.`` is ``midlayer.``, ``layers.i.`` is ``blocks.{i-1}.``."""
    mt = _LAYER.match(name)
    if mt is None:
        return name
    i = int(mt.group(1))
    return ("midlayer." if i == 0 else f"blocks.{i - 1}.") + name[mt.end():]


def checkpoint_to_head(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> ``Eagle3Head.state_dict()`` names (q/k/v and gate/up fused)."""
    renamed = {_head_name(k): v for k, v in ckpt.items() if k != "embed_tokens.weight"}
    out: dict[str, torch.Tensor] = {}
    for name, t in renamed.items():
        if name.endswith(("self_attn.q_proj.weight", "mlp.gate_proj.weight")):
            a = name.rsplit(".", 2)[0]  # "midlayer.self_attn" / "blocks.0.mlp"
            if name.endswith("q_proj.weight"):
                k, v = renamed[a + ".k_proj.weight"], renamed[a + ".v_proj.weight"]
                out[a + ".qkv_proj.weight"] = torch.cat([t, k, v])
            else:
                out[a + ".gate_up_proj.weight"] = torch.cat([t, renamed[a + ".up_proj.weight"]])
        elif not name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight", "mlp.up_proj.weight")):
            out[name] = t
    return out


# ----------------------------------------------------------------------------------------------
# export / import / validate
# ----------------------------------------------------------------------------------------------


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    write_synced(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def export_eagle3(head: Eagle3Head, directory: Path | str, embed: torch.nn.Embedding | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (fsynced) into ``directory`` (created if needed).

    Not atomic by itself; ``publish`` wraps it in a temp-dir + rename.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = head_to_checkpoint(head.cfg, head.state_dict())
    if embed is not None:
        tensors["embed_tokens.weight"] = embed.weight.detach().to(head.dtype).contiguous().clone()
    save_file(tensors, str(d / WEIGHTS_NAME), metadata={"format": "pt"})
    fsync_path(d / WEIGHTS_NAME)
    _write_json(d / CONFIG_NAME, config_to_hf(head.cfg, head.dtype))
    fsync_path(d)


def _read_config(d: Path) -> dict[str, Any]:
    try:
        with open(d / CONFIG_NAME, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise DrafterCheckpointError(f"{d} has no {CONFIG_NAME}") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DrafterCheckpointError(f"{d / CONFIG_NAME} is unreadable: {str(exc).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise DrafterCheckpointError(f"{d / CONFIG_NAME} is not a JSON object")
    return cfg


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    path = d / WEIGHTS_NAME
    if not path.is_file():
        raise DrafterCheckpointError(f"{d} has no {WEIGHTS_NAME}")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise DrafterCheckpointError(f"{path} is unreadable: {str(exc).splitlines()[0]}") from None


def _check_tensors(cfg: Eagle3Config, tensors: dict[str, torch.Tensor]) -> None:
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in tensors:
            raise DrafterCheckpointError(f"checkpoint is missing tensor {name}")
        if tuple(tensors[name].shape) != shape:
            raise DrafterCheckpointError(f"tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    for name, t in tensors.items():
        if name == "embed_tokens.weight":
            if tuple(t.shape) != (cfg.target_vocab_size, cfg.hidden_size):
                raise DrafterCheckpointError(f"tensor {name} has shape {tuple(t.shape)}, "
                                             f"expected {(cfg.target_vocab_size, cfg.hidden_size)}")
        elif name not in expected:
            raise DrafterCheckpointError(f"unexpected tensor {name} in checkpoint")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DrafterCheckpointError(f"tensor {name} has non-finite values")
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise DrafterCheckpointError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    targets = torch.arange(cfg.draft_vocab_size) + d2t  # [Vd]
    if cfg.draft_vocab_size and (int(targets.min()) < 0 or int(targets.max()) >= cfg.target_vocab_size):
        raise DrafterCheckpointError("d2t maps a draft id outside the target vocabulary")
    if torch.unique(targets).numel() != cfg.draft_vocab_size:
        raise DrafterCheckpointError("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[targets].all()):
        raise DrafterCheckpointError("t2d does not mark exactly the target ids d2t maps to")


def import_eagle3(directory: Path | str, target_cfg: TargetConfig | None = None
                  ) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """Read a checkpoint dir -> (config, ``Eagle3Head.state_dict()``-named tensors).

    Checkpoints without ``d2t``/``t2d`` are accepted when the draft vocabulary is the full target
    vocabulary (identity map), as vLLM does. ``embed_tokens.weight`` is ignored (the target's is used).
    """
    d = Path(directory)
    cfg = config_from_hf(_read_config(d), target_cfg)
    tensors = _read_tensors(d)
    if "d2t" not in tensors and "t2d" not in tensors and cfg.draft_vocab_size == cfg.target_vocab_size:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
        tensors["t2d"] = torch.ones(cfg.target_vocab_size, dtype=torch.bool)
    _check_tensors(cfg, tensors)
    return cfg, checkpoint_to_head(tensors)


def validate_eagle3_dir(directory: Path | str, target_cfg: TargetConfig) -> None:
    """Raise ``DrafterCheckpointError`` unless the dir is a complete, finite EAGLE-3 checkpoint for
    ``target_cfg`` (names, shapes, vocab maps, width, vocabulary, tap layers)."""
    try:
        cfg, _ = import_eagle3(directory, target_cfg)
    except Eagle3ConfigError as exc:
        raise DrafterCheckpointError(f"bad EAGLE-3 config: {exc}") from None
    _check_fit(cfg, target_cfg)


def _check_fit(cfg: Eagle3Config, target_cfg: TargetConfig) -> None:
    """Raise ``DrafterCheckpointError`` unless a head of ``cfg`` reads ``target_cfg``'s hidden
    states and vocabulary."""
    if cfg.hidden_size != target_cfg.hidden_size:
        raise DrafterCheckpointError(f"hidden_size {cfg.hidden_size} != target hidden_size {target_cfg.hidden_size}")
    if cfg.target_vocab_size != target_cfg.vocab_size:
        raise DrafterCheckpointError(f"vocab_size {cfg.target_vocab_size} != target vocab_size {target_cfg.vocab_size}")
    if cfg.tap_layers[-1] >= target_cfg.num_layers:
        raise DrafterCheckpointError(f"tap layers {cfg.tap_layers} exceed the target's {target_cfg.num_layers} layers")


# ----------------------------------------------------------------------------------------------
# versioned publish area
# ----------------------------------------------------------------------------------------------


def publish(root: Path | str, head: Eagle3Head, metrics: dict[str, Any],
            embed: torch.nn.Embedding | None = None) -> int:
    """Write ``root/v{N}`` atomically and point ``LATEST`` at it (``files.publish_version``); returns N."""
    return publish_version(Path(root), lambda d: export_eagle3(head, d, embed), metrics)


def seed_root(root: Path | str, source: Path | str, target_cfg: TargetConfig, dtype: torch.dtype = torch.float32,
              device: torch.device | str = "cpu") -> int | None:
    """Publish the drafter ``source`` holds (``load_drafter_source``) as the first version of ``root``
    when ``root`` holds no valid version, so that online training fine-tunes it rather than a random
    head; returns that version, or None when ``root`` already had one (nothing written). Its metrics
    name the source (``bootstrap``): a head that never trained on the traffic it is about to serve
    (``is_seed``). Processes seeding one root at once (a fleet's replicas) publish it once.

    Example: an empty ``runs/drafter`` and the shipped head -> 1 (``runs/drafter/v1``); again -> None.
    """
    r = Path(root)
    r.mkdir(parents=True, exist_ok=True)
    with open(r / SEED_LOCK_NAME, "a+", encoding="utf-8") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        if load_latest_valid(r, target_cfg) is not None:
            return None
        pub = load_drafter_source(source, target_cfg)
        if pub is None:
            raise DrafterCheckpointError(f"{source} holds no valid EAGLE-3 drafter for this target")
        head = head_from_published(pub, dtype, device)
        return publish(r, head, {"bootstrap": str(source), "bootstrap_version": pub.version})


def is_seed(root: Path | str) -> bool:
    """Whether ``root``'s newest version is a head ``seed_root`` published (its metrics name a
    ``bootstrap``), not one trained on this root's traffic; False without a readable version."""
    n = latest_version(root)
    if n is None:
        return False
    try:
        metrics = _version_metrics(Path(root) / f"v{n}")
    except (DrafterCheckpointError, ValueError):  # unreadable, or not text
        return False
    return isinstance(metrics, dict) and "bootstrap" in metrics


def _version_metrics(d: Path) -> Any:
    """A version directory's ``metrics.json``, parsed ({} when it has none)."""
    try:
        metrics = json.loads((d / METRICS_NAME).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as exc:
        raise DrafterCheckpointError(f"{d / METRICS_NAME} is unreadable: {str(exc).splitlines()[0]}") from None
    return metrics


def load_version(root: Path | str, version: int, target_cfg: TargetConfig | None = None) -> PublishedDrafter:
    """Read ``root/v{version}``; with ``target_cfg`` it is validated against the target first."""
    d = Path(root) / f"v{version}"
    if not d.is_dir():
        raise DrafterCheckpointError(f"version {version} not found under {root}")
    if target_cfg is not None:
        validate_eagle3_dir(d, target_cfg)
    cfg, sd = import_eagle3(d, target_cfg)
    return PublishedDrafter(version=version, config=cfg, state_dict=sd, metrics=_version_metrics(d))


def state_dict_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Bitwise equality of two state dicts (names, dtypes, shapes, values)."""
    if a.keys() != b.keys():
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------
# heads for serving: fresh, published, exported
# ----------------------------------------------------------------------------------------------


def fresh_head(target_cfg: TargetConfig, draft_vocab_size: int | None = None, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", seed: int = FRESH_HEAD_SEED, num_layers: int = 1,
               fusion: str = "concat") -> Eagle3Head:
    """A randomly initialised head, identical for equal arguments (the global RNG is untouched).

    The engine starts from it when nothing is published yet, and the trainer evaluates it as the
    "current" drafter then, so both sides agree on what version 0 is.
    """
    vocab = draft_vocab_size if draft_vocab_size else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = Eagle3Head(Eagle3Config.for_target(target_cfg, vocab, num_layers, fusion))
    return head.to(dtype=dtype, device=device).eval()


def head_from_published(pub: PublishedDrafter, dtype: torch.dtype, device: torch.device | str) -> Eagle3Head:
    """An ``Eagle3Head`` holding a published (or imported) state dict."""
    head = Eagle3Head(pub.config)
    head.load_state_dict(pub.state_dict)
    return head.to(dtype=dtype, device=device).eval()


def is_checkpoint_dir(path: Path | str) -> bool:
    """A single exported checkpoint (``config.json`` inside) rather than a publish root."""
    return (Path(path) / CONFIG_NAME).is_file()


def load_latest_valid(root: Path | str, target_cfg: TargetConfig) -> PublishedDrafter | None:
    """The newest version under ``root`` that validates against the target, newest first; each
    refused version is logged. None when the root holds no valid version."""
    newest = latest_version(root)
    candidates = sorted({v for v in list_versions(root) if newest is None or v <= newest}, reverse=True)
    for version in candidates:
        try:
            return load_version(root, version, target_cfg)
        except DrafterCheckpointError as exc:
            logger.warning("refusing EAGLE-3 drafter version %d under %s: %s", version, root, exc)
    return None


def load_drafter_source(source: str | Path, target_cfg: TargetConfig) -> PublishedDrafter | None:
    """What ``source`` holds: a directory with ``config.json`` -> that exported checkpoint
    (validated; a bad one raises ``DrafterCheckpointError``) as version 0; otherwise a publish
    root -> its newest valid version, or None when it has none."""
    if is_checkpoint_dir(source):
        validate_eagle3_dir(source, target_cfg)
        config, state = import_eagle3(source, target_cfg)
        return PublishedDrafter(0, config, state, {})
    return load_latest_valid(source, target_cfg)
