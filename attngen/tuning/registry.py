"""The registry of tuned kernel configs: one YAML file per GPU, `tuned/<gpu>.yaml` (format in tuned/README.md).

Two places hold registry files in the one format: the user's own folder (`user_dir()`, written by
`attngen tune`) and the folder shipped in the package (`shipped_dir()`). A `Registry` reads the
user's file first, then the shipped one, and says which entry it used and why. An entry's key
names its kernel family (`kernel: fwd`), and the entry the family's kernel revision it was tuned on
(`revision`, attngen.families): a lookup uses only entries of the revision it asks for. Files of
schema versions 1 (which called the family `direction`) and 2 have no revisions: their entries are
read as revision 1, and the files are written back as version 3.

Reading never raises for bad content: a broken file or entry gives a `RegistryWarning` and is
skipped. Writing merges under an exclusive lock and replaces the file atomically, so concurrent
tuners lose nothing and a reader never sees half a file.
"""

from __future__ import annotations

import datetime
import fcntl
import math
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..checks import topk_pad
from ..config import KernelConfig
from ..dtypes import BYTES as DTYPE_BYTES
from ..paths import data_dir, user_registry_dir

SCHEMA_VERSION = 3
READ_VERSIONS = (1, 2, 3)  # version 1 named the kernel family `direction`; 1 and 2 have no `revision`
UNREVISED = 1  # the revision of an entry of a version 1 or 2 file
INTERPRETER = "interpreter"  # the gpu key of Triton's CPU interpreter

# the fields of attngen.config.KernelConfig, with the YAML type each must have
CONFIG_FIELDS = {"block_m": int, "block_n": int, "num_warps": int, "num_stages": int,
                 "use_tma": bool, "warp_specialize": bool}
KEY_FIELDS = ("variant", "kernel", "dtype", "head_dim", "seq_bucket", "group", "batch_bucket")
OPTIONAL_KEY_FIELDS = {"batch_bucket": 0}  # a field a file may leave out, and its value then
ENTRY_FIELDS = KEY_FIELDS + ("revision", "config", "ms", "tflops", "sdpa_ms", "trials", "triton", "torch", "date")
FILE_FIELDS = ("version", "gpu", "device_name", "entries")

# libyaml's parser and emitter when PyYAML has them: the same safe (de)constructors, several times
# faster, and the same bytes as PyYAML's pure-Python emitter (tests/tuning/test_registry.py checks)
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# block style, except configs (mappings of scalars only) on one line; no line wrapping
_DUMP_STYLE = dict(sort_keys=False, default_flow_style=None, allow_unicode=True, width=1 << 16)

# words of a CUDA device name that are not the model: vendor and brand words, memory size and
# type, form factor ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200 NVL")
_NOISE_WORD = re.compile(r"nvidia|tesla|geforce|quadro|gpu|generation|pcie|nvl|dgxs|sxm\d*|hbm\d*e?|\d+gb")


class RegistryWarning(UserWarning):
    """A registry file or entry that cannot be used; it is skipped."""


def gpu_key(device_name: str) -> str:
    """The registry key of a CUDA device name: "NVIDIA H100 80GB HBM3" -> "h100"."""
    words = re.split(r"[\s\-_/]+", device_name.lower())
    key = "".join(re.sub(r"[^a-z0-9]", "", w) for w in words if w and not _NOISE_WORD.fullmatch(w))
    if not key:
        raise ValueError(f"cannot make a gpu key of the device name {device_name!r}")
    return key


def variant_of(mask, topk: int = 0) -> str:
    """The registry's name of a kernel variant: the mask's variant ("none" without a mask), plus
    `topk(<K rounded up to a power of two>)` for top-k (topk as check_topk returns it)."""
    base = mask.variant if mask is not None else "none"
    if not topk:
        return base
    pad = topk_pad(topk)
    return f"topk({pad})" if mask is None else f"{base} & topk({pad})"


def seq_bucket(n: int) -> int:
    """The sequence-length bucket of `n`: the power of two >= n, at least 16."""
    if n < 0:
        raise ValueError(f"sequence length {n} is negative")
    return max(16, 1 << (n - 1).bit_length())


def batch_bucket(n: int) -> int:
    """The batch bucket of `n` (families that tune per batch): the power of two >= n."""
    if n < 1:
        raise ValueError(f"batch {n} must be >= 1")
    return 1 << (n - 1).bit_length()


def user_dir() -> Path:
    """The user registry: ATTNGEN_USER_REGISTRY, else $XDG_CONFIG_HOME/attngen/tuned, else
    ~/.config/attngen/tuned."""
    return user_registry_dir()


def shipped_dir() -> Path:
    """The registry folder shipped with this installation."""
    return data_dir("tuned")


# ---------------------------------------------------------------------------------------------
# entries


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _is_block(value) -> bool:
    return _is_int(value) and value >= 16 and not value & (value - 1)


@dataclass(frozen=True)
class EntryKey:
    """What a tuned config was tuned for; `seq_bucket` is `seq_bucket(kv_len)` (the tuner runs Sq = Sk)."""
    variant: str  # the mask variant's text, "none" without a mask
    kernel: str  # the kernel family (attngen.families), e.g. "fwd"
    dtype: str  # "fp16", "bf16" or "fp32"
    head_dim: int
    seq_bucket: int
    group: int  # GQA group: query heads per kv head
    batch_bucket: int = 0  # 0: any batch; families that tune per batch (decode): batch_bucket(batch)

    def __post_init__(self):
        problems = []
        if not isinstance(self.variant, str) or not self.variant:
            problems.append(f"variant={self.variant!r} must be a non-empty string")
        if not isinstance(self.kernel, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.kernel):
            problems.append(f"kernel={self.kernel!r} must be a kernel family name such as 'fwd'")
        if self.dtype not in DTYPE_BYTES:
            problems.append(f"dtype={self.dtype!r} must be one of {', '.join(DTYPE_BYTES)}")
        if not (_is_int(self.head_dim) and self.head_dim >= 1):
            problems.append(f"head_dim={self.head_dim!r} must be a positive integer")
        if not _is_block(self.seq_bucket):
            problems.append(f"seq_bucket={self.seq_bucket!r} must be a power of two >= 16")
        if not (_is_int(self.group) and self.group >= 1):
            problems.append(f"group={self.group!r} must be an integer >= 1")
        if not (_is_int(self.batch_bucket) and (self.batch_bucket == 0 or self.batch_bucket & (self.batch_bucket - 1) == 0)):
            problems.append(f"batch_bucket={self.batch_bucket!r} must be 0 (any batch) or a power of two")
        if problems:
            raise ValueError("; ".join(problems))

    def sort_key(self) -> tuple:
        """File order: all buckets of one (variant, kernel, dtype, head dim, group) together."""
        return (self.variant, self.kernel, self.dtype, self.head_dim, self.group, self.seq_bucket, self.batch_bucket)

    def without_bucket(self) -> tuple:
        """Everything but the sequence and batch buckets: the entries a nearest-bucket lookup may use."""
        return (self.variant, self.kernel, self.dtype, self.head_dim, self.group)


@dataclass
class Entry:
    """One tuned winner: the config and what it measured (times in ms, SDPA in the same run) on
    revision `revision` of its family's kernels."""
    key: EntryKey
    revision: int
    config: dict
    ms: float
    tflops: float
    sdpa_ms: float | None
    trials: int
    triton: str
    torch: str
    date: str  # ISO date, "2026-11-29"

    def __post_init__(self):
        if not isinstance(self.key, EntryKey):
            raise ValueError(f"key must be an EntryKey, got {type(self.key).__name__}")
        problems = _config_problems(self.config, self.key)
        if not (_is_int(self.revision) and self.revision >= 1):
            problems.append(f"revision={self.revision!r} must be an integer >= 1")
        if not (_is_number(self.ms) and self.ms > 0):
            problems.append(f"ms={self.ms!r} must be a positive number")
        if not (_is_number(self.tflops) and self.tflops > 0):
            problems.append(f"tflops={self.tflops!r} must be a positive number")
        if self.sdpa_ms is not None and not (_is_number(self.sdpa_ms) and self.sdpa_ms > 0):
            problems.append(f"sdpa_ms={self.sdpa_ms!r} must be a positive number or null")
        if not (_is_int(self.trials) and self.trials >= 1):
            problems.append(f"trials={self.trials!r} must be an integer >= 1")
        for name in ("triton", "torch"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                problems.append(f"{name}={getattr(self, name)!r} must be a version string")
        if not _is_iso_date(self.date):
            problems.append(f"date={self.date!r} must be an ISO date (YYYY-MM-DD)")
        if problems:
            raise ValueError("; ".join(problems))
        self.config = {name: self.config[name] for name in CONFIG_FIELDS}  # own copy, fixed order
        self.ms, self.tflops = float(self.ms), float(self.tflops)
        self.sdpa_ms = None if self.sdpa_ms is None else float(self.sdpa_ms)

    def is_better_than(self, other: Entry) -> bool:
        """Whether this entry replaces `other` of the same key: a later revision of the kernels, or
        the same revision and faster."""
        return (self.revision, self.tflops) > (other.revision, other.tflops)

    def kernel_config(self) -> KernelConfig:
        return KernelConfig(**self.config)

    def as_dict(self) -> dict:
        """The entry as written to the file, fields in file order."""
        out = {name: getattr(self.key, name) for name in KEY_FIELDS
               if getattr(self.key, name) != OPTIONAL_KEY_FIELDS.get(name, object())}  # optional fields at their default left out
        out.update(revision=self.revision, config=dict(self.config), ms=self.ms, tflops=self.tflops,
                   sdpa_ms=self.sdpa_ms, trials=self.trials, triton=self.triton, torch=self.torch, date=self.date)
        return out


def _config_problems(config, key: EntryKey) -> list[str]:
    if not isinstance(config, dict):
        return [f"config must be a mapping, got {type(config).__name__}"]
    missing = [name for name in CONFIG_FIELDS if name not in config]
    unknown = [str(name) for name in config if name not in CONFIG_FIELDS]
    out = []
    if missing:
        out.append(f"config lacks {', '.join(missing)}")
    if unknown:
        out.append(f"config has unknown fields {', '.join(unknown)}")
    for name, kind in CONFIG_FIELDS.items():
        value = config.get(name)
        if name in config and not (isinstance(value, bool) if kind is bool else _is_int(value)):
            out.append(f"config {name}={value!r} must be {'true or false' if kind is bool else 'an integer'}")
    if out:
        return out
    # the value rules (powers of two, warps, stages) are KernelConfig's, the one validity check
    return KernelConfig(**config).problems(key.head_dim, DTYPE_BYTES[key.dtype], kernel=key.kernel)


def _is_iso_date(value) -> bool:
    try:
        return isinstance(value, str) and datetime.date.fromisoformat(value).isoformat() == value
    except ValueError:
        return False


def _entry_from_mapping(raw, version: int = SCHEMA_VERSION) -> Entry:
    """Parse one entry of a file of schema `version`; ValueError says what is wrong."""
    if not isinstance(raw, dict):
        raise ValueError(f"must be a mapping, got {type(raw).__name__}")
    if version == 1 and "direction" in raw and "kernel" not in raw:
        raw = {("kernel" if name == "direction" else name): value for name, value in raw.items()}
    if version < 3 and "revision" not in raw:
        raw = {**raw, "revision": UNREVISED}
    missing = [name for name in ENTRY_FIELDS if name not in raw and name not in OPTIONAL_KEY_FIELDS]
    unknown = [str(name) for name in raw if name not in ENTRY_FIELDS]
    if missing or unknown:
        raise ValueError("; ".join(([f"lacks {', '.join(missing)}"] if missing else [])
                                   + ([f"unknown fields {', '.join(unknown)}"] if unknown else [])))
    fields = dict(raw)
    if isinstance(fields["date"], datetime.date):  # an unquoted date in a hand-edited file
        fields["date"] = fields["date"].isoformat()
    key = EntryKey(**{name: fields.pop(name, OPTIONAL_KEY_FIELDS.get(name)) for name in KEY_FIELDS})
    return Entry(key=key, **fields)


def _describe(index: int, raw) -> str:
    """How a warning names an entry: its index and whatever key fields it has."""
    if not isinstance(raw, dict):
        return f"entry {index}"
    known = ", ".join(f"{name}={raw[name]!r}" for name in KEY_FIELDS if name in raw)
    return f"entry {index} ({known})" if known else f"entry {index}"


# ---------------------------------------------------------------------------------------------
# files


@dataclass
class RegistryFile:
    gpu: str
    device_name: str
    entries: dict[EntryKey, Entry] = field(default_factory=dict)
    path: Path | None = None  # where it was read from or written to

    def as_dict(self) -> dict:
        return {"version": SCHEMA_VERSION, "gpu": self.gpu, "device_name": self.device_name,
                "entries": [self.entries[key].as_dict() for key in sorted(self.entries, key=EntryKey.sort_key)]}


def _warn(message: str):
    warnings.warn(f"attngen: {message}", RegistryWarning, stacklevel=3)


def _read(path: Path, skipped: list[int] | None = None) -> tuple[RegistryFile | None, str | None]:
    """(the file, None), or (None, why it cannot be used); (None, None) when there is no file.

    The indices of invalid entries (skipped with a warning) are appended to `skipped`.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        return None, f"cannot read it ({e})"
    try:
        data = yaml.load(text, Loader=_SAFE_LOADER)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        return None, f"not valid YAML{where}: {getattr(e, 'problem', None) or e}"
    if data is None:
        return None, "the file is empty"
    if not isinstance(data, dict):
        return None, f"the top level must be a mapping with {', '.join(FILE_FIELDS)}, got {type(data).__name__}"
    if "version" not in data:
        return None, "it has no version"
    if data["version"] not in READ_VERSIONS:
        return None, f"version {data['version']!r}, this attngen reads versions {', '.join(map(str, READ_VERSIONS))}"
    unknown = [str(name) for name in data if name not in FILE_FIELDS]
    if unknown:
        return None, f"unknown top-level fields {', '.join(unknown)}"
    gpu = data.get("gpu")
    problems = []  # every top-level problem at once: the first alone may not be the one the user made
    if not isinstance(gpu, str) or not re.fullmatch(r"[a-z0-9]+", gpu):
        problems.append(f"gpu={gpu!r} must be a gpu key (lowercase letters and digits)")
    if not isinstance(data.get("device_name"), str):
        problems.append(f"device_name={data.get('device_name')!r} must be a string")
    if not isinstance(data.get("entries"), list):
        problems.append(f"entries={data.get('entries')!r} must be a list of entries, got "
                        f"{type(data.get('entries')).__name__}")
    if problems:
        return None, "; ".join(problems)

    out = RegistryFile(gpu=gpu, device_name=data["device_name"], path=path)
    first_index = {}
    for index, raw in enumerate(data["entries"]):
        try:
            entry = _entry_from_mapping(raw, data["version"])
        except (TypeError, ValueError) as e:
            _warn(f"skipping {_describe(index, raw)} of registry {path}: {e}")
            if skipped is not None:
                skipped.append(index)
            continue
        old = out.entries.get(entry.key)
        if old is not None:  # e.g. two tuners' files merged by hand: keep the better one
            keep_new = entry.is_better_than(old)
            dropped, kept = (first_index[entry.key], index) if keep_new else (index, first_index[entry.key])
            winner = entry if keep_new else old
            why = (f"of a later kernel revision ({winner.revision})" if entry.revision != old.revision
                   else "at least as fast")
            _warn(f"skipping entry {dropped} of registry {path}: same key as entry {kept}, which is {why}")
            if not keep_new:
                continue
        out.entries[entry.key] = entry
        first_index[entry.key] = index
    out.entries = {key: out.entries[key] for key in sorted(out.entries, key=EntryKey.sort_key)}
    return out, None


def load_file(path) -> RegistryFile | None:
    """The registry file at `path`; None when it is missing (silently) or unusable (with a warning)."""
    path = Path(path)
    out, reason = _read(path)
    if reason is not None:
        _warn(f"ignoring registry {path}: {reason}")
    return out


def write_entries(path, entries: list[Entry], gpu: str, device_name: str) -> RegistryFile:
    """Merge `entries` into the file at `path`, keeping the better entry per key; returns the new file.

    Concurrent writers are serialised by an exclusive lock on `<path>.lock`; the new content goes
    to a temporary file in the same folder that then replaces the old one, so a reader sees either
    the old or the new file and a crash leaves the old one in place.
    """
    if not re.fullmatch(r"[a-z0-9]+", gpu):
        raise ValueError(f"gpu={gpu!r} must be a gpu key (lowercase letters and digits), see gpu_key()")
    path = Path(path).resolve()  # replace a symlink's target, not the link
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            skipped = []
            current, reason = _read(path, skipped)
            # never drop what we cannot read: keep the old file beside the new one
            aside = path.with_name(f"{path.name}.invalid-{datetime.datetime.now():%Y%m%dT%H%M%S}")
            if reason is not None:
                os.replace(path, aside)
                _warn(f"registry {path} is unusable ({reason}); moved it to {aside} and starting a new one")
            elif skipped:
                shutil.copyfile(path, aside)
                _warn(f"registry {path}: dropping its invalid entries {', '.join(map(str, skipped))}; "
                      f"the old file is kept as {aside}")
            if current is None:
                current = RegistryFile(gpu=gpu, device_name=device_name)
            elif current.gpu != gpu:
                raise ValueError(f"registry {path} is for gpu {current.gpu!r}, not {gpu!r}")
            merged = dict(current.entries)
            for entry in entries:
                old = merged.get(entry.key)
                if old is None or entry.is_better_than(old):
                    merged[entry.key] = entry
            out = RegistryFile(gpu=gpu, device_name=current.device_name,
                               entries={key: merged[key] for key in sorted(merged, key=EntryKey.sort_key)},
                               path=path)
            _replace(path, out.as_dict())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


def _replace(path: Path, data: dict):
    """Write `data` to a temporary file beside `path`, then move it over `path` in one step."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            yaml.dump(data, f, Dumper=_SAFE_DUMPER, **_DUMP_STYLE)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def file_for(path: Path, gpu: str) -> Path:
    """The file a registry path means for `gpu`: a folder's `<gpu>.yaml`, or the file itself."""
    path = Path(path)
    return path / f"{gpu}.yaml" if path.is_dir() else path


def gpus_in(paths: list[Path]) -> list[str]:
    """The gpu keys that `paths` hold registry files for (a folder's `<gpu>.yaml` names, a file's `gpu`)."""
    found = set()
    for path in map(Path, paths):
        if path.is_dir():
            found.update(p.stem for p in path.glob("*.yaml"))
        elif path.is_file():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RegistryWarning)
                source, _ = _read(path)
            if source is not None:
                found.add(source.gpu)
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# lookups


class Registry:
    """Registry files in order of preference: the user's first, then the shipped ones."""

    def __init__(self, sources: list[RegistryFile], unusable: dict[Path, str] | None = None,
                 skipped: dict[Path, list[int]] | None = None):
        self.sources = list(sources)
        self.unusable = dict(unusable or {})  # file -> why it was ignored (a warning said so)
        self.skipped = dict(skipped or {})  # file -> indices of its invalid entries (skipped with a warning)
        self._buckets: dict[tuple, list[tuple[int, Entry]]] = {}
        for rank, source in enumerate(self.sources):
            for entry in source.entries.values():
                self._buckets.setdefault(entry.key.without_bucket(), []).append((rank, entry))

    @classmethod
    def load(cls, paths: list[Path], gpu: str) -> Registry:
        """Read each path: a folder gives its `<gpu>.yaml`, a file is read as it is."""
        sources, unusable, skipped = [], {}, {}
        for path in map(Path, paths):
            path = file_for(path, gpu)
            source, reason = _read(path, skipped.setdefault(path, []))
            if source is not None and source.gpu != gpu:
                source, reason = None, f"it is for gpu {source.gpu!r}, not {gpu!r}"
            if reason is not None:
                _warn(f"ignoring registry {path}: {reason}")
                unusable[path] = reason
            elif source is not None:
                sources.append(source)
        return cls(sources, unusable, {path: indices for path, indices in skipped.items() if indices})

    def lookup(self, key: EntryKey, revision: int | None) -> tuple[Entry, str] | None:
        """The entry for `key` tuned on kernel revision `revision` (None: any revision), and why it
        was chosen; None when no entry fits.

        An exact entry wins (the first source that has one); otherwise the nearest sequence bucket
        of the same variant, kernel, dtype, head dim and group: nearest in log2 distance, then
        the earlier source, then the larger bucket; among those, the nearest batch bucket likewise
        (for the families that tune per batch).
        """
        for source in self.sources:
            entry = source.entries.get(key)
            if entry is not None and revision in (None, entry.revision):
                return entry, f"exact entry in {source.path}"
        candidates = [(rank, entry) for rank, entry in self._buckets.get(key.without_bucket(), ())
                      if revision in (None, entry.revision)]
        if not candidates:
            return None
        want, batch = key.seq_bucket.bit_length(), key.batch_bucket.bit_length()
        rank, entry = min(candidates, key=lambda c: (abs(c[1].key.seq_bucket.bit_length() - want), c[0],
                                                     -c[1].key.seq_bucket,
                                                     abs(c[1].key.batch_bucket.bit_length() - batch),
                                                     -c[1].key.batch_bucket))
        found = f"nearest sequence bucket {entry.key.seq_bucket} (asked {key.seq_bucket})"
        if entry.key.seq_bucket == key.seq_bucket:
            found = f"nearest batch bucket {entry.key.batch_bucket} (asked {key.batch_bucket})"
        elif key.batch_bucket:
            found += f", batch bucket {entry.key.batch_bucket} (asked {key.batch_bucket})"
        return entry, f"{found} in {self.sources[rank].path}"

    def other_revisions(self, key: EntryKey, revision: int) -> list[tuple[Path | None, Entry]]:
        """(source path, entry) of the entries a lookup of `key` at `revision` ignores for their
        revision: those of any bucket of the same variant, kernel, dtype, head dim and group."""
        return [(self.sources[rank].path, entry) for rank, entry in self._buckets.get(key.without_bucket(), ())
                if entry.revision != revision]

    def entries(self) -> Iterator[tuple[Path | None, Entry]]:
        """Every (source path, entry), sources in order of preference."""
        for source in self.sources:
            for entry in source.entries.values():
                yield source.path, entry
