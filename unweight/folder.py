"""What a checkpoint folder holds, for reading and writing alike: which files are tensors, which
are copied, the shard index, the list of containers that makes a compressed folder one model
(its member list), and the rules every file must pass (regular files only; links stay inside the
folder; no pickle)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from unweight.errors import SourceError
from unweight.formats.safetensors_file import file_header_digest, file_kind

INDEX_NAME = "model.safetensors.index.json"
MEMBERS_NAME = "unweight-folder.json"  # written by compress: the folder's containers and their header digests
MEMBERS_FORMAT = "unweight-folder/1"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
SKIP_DIRS = {".git", ".cache", "__pycache__"}


def walk(root: Path) -> list[Path]:
    """Files under root (relative paths, sorted), skipping VCS and cache folders.

    Every one is a regular file, or a symbolic link that resolves to a regular file inside the tree
    links may point into (_link_tree: the folder itself, or a Hub cache snapshot's repo folder);
    what `compress` and `decompress` copy are then the link's contents. Anything else (a FIFO,
    a device, a broken link, a link leaving the folder, to a file or to a folder) raises SourceError
    naming it: a FIFO would hang the run, and an outside link would copy an unrelated file into the
    output. Links to folders inside the tree are not followed (their files are listed where they lie).
    """
    tree = _link_tree(root)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for d in [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            _check_link(Path(dirpath) / d, tree)
            dirnames.remove(d)
        for f in sorted(filenames):
            path = Path(dirpath) / f
            if path.is_symlink():
                _check_link(path, tree)
            _check_regular(path, SourceError)
            out.append(path.relative_to(root))
    return out


def _link_tree(root: Path) -> Path:
    """The folder a link under `root` may resolve into: `root` itself, or, for a Hugging Face cache
    snapshot (.../models--ORG--NAME/snapshots/REV, whose files link to ../../blobs), the repo's
    cache folder."""
    real = root.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        return real.parent.parent
    return real


def _check_link(path: Path, tree: Path) -> None:
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):  # missing target, or a loop
        raise SourceError(f"{path}: broken symbolic link (-> {os.readlink(path)})") from None
    if not target.is_relative_to(tree):
        raise SourceError(
            f"{path}: symbolic link to {target}, outside {tree}; copy the file into the folder or remove the link"
        )


def _check_regular(path: Path, error: type[Exception]) -> None:
    """Raise `error` naming `path` unless it is (or links to) a regular file: opening a FIFO
    would wait forever for a writer."""
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise error(f"{path}: not a regular file ({file_kind(mode)})")


def check_source(src: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(safetensors files, other files to copy, skipped pickle files) of a source folder."""
    if not src.exists():
        raise SourceError(f"{src}: no such file or folder")
    if not src.is_dir():
        _check_regular(src, SourceError)
        if src.suffix != ".safetensors":
            raise SourceError(
                _pickle_message(src)
                if src.suffix in PICKLE_SUFFIXES
                else f"{src}: not a .safetensors file or a model folder"
            )
        return [Path(src.name)], [], []
    files = walk(src)
    tensors = [f for f in files if f.suffix == ".safetensors"]
    pickles = [f for f in files if f.suffix in PICKLE_SUFFIXES]
    if not tensors:
        if pickles:
            raise SourceError(_pickle_message(src / pickles[0]))
        raise SourceError(f"{src}: no *.safetensors files in this folder")
    others = [f for f in files if f.suffix != ".safetensors" and f not in pickles]
    return tensors, others, pickles


def _pickle_message(path: Path) -> str:
    return (
        f"{path}: pickle checkpoint refused: loading pickle can run arbitrary code, and its bytes are "
        "not a stable tensor layout; convert it to safetensors first (transformers: "
        "model.save_pretrained(dir, safe_serialization=True))"
    )


def read_json(path: Path, max_bytes: int | None = None):
    """A JSON file the user gave (a shard index), or SourceError naming it: invalid UTF-8 or JSON,
    numbers past Python's 4300-digit limit and nesting past the recursion limit included; a FIFO
    or other special file is refused, not waited on; with `max_bytes`, one longer than that is
    refused after reading one byte past it (a file that grows meanwhile too)."""
    _check_regular(path, SourceError)
    try:
        with open(path, "rb") as f:
            raw = f.read() if max_bytes is None else f.read(max_bytes + 1)
        if max_bytes is not None and len(raw) > max_bytes:
            raise SourceError(f"{path}: over the {max_bytes:,} bytes this file may have")
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise SourceError(f"{path}: not valid UTF-8 JSON ({e.__class__.__name__}: {str(e)[:200]})") from None
    except OSError as e:
        raise SourceError(f"{path}: cannot read: {e.strerror}") from None


def _check_index(index: Path, root: Path) -> dict:
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"{index}: no weight_map of tensor name -> shard file")
    for shard in sorted(set(weight_map.values())):
        if "\x00" in shard or ".." in Path(shard).parts or Path(shard).is_absolute():  # NUL: no path at all
            raise SourceError(f"{index}: shard path {shard!r} leaves the folder or is not a path")
    return data


@dataclass(frozen=True)
class Index:
    """A folder's shard index (model.safetensors.index.json): which shard holds each tensor. In a
    sharded folder it is the truth: a reader trusts the shards only once they hold exactly what it
    lists (`problems`), since a partial download otherwise loads as a model with tensors missing."""

    path: Path
    shard_of: dict[str, Path]  # tensor name -> shard file, relative to the folder

    @cached_property
    def _by_shard(self) -> dict[Path, set[str]]:
        """shard -> the tensors it lists there (grouped once: a big index has 100k tensors)."""
        out: dict[Path, set[str]] = {}
        for name, shard in self.shard_of.items():
            out.setdefault(shard, set()).add(name)
        return out

    @property
    def shards(self) -> list[Path]:
        return sorted(self._by_shard)

    def tensors_in(self, shard: Path) -> set[str]:
        return self._by_shard.get(shard, set())

    def missing_shards(self) -> list[Path]:
        return [s for s in self.shards if not (self.path.parent / s).is_file()]

    def problems(self, held: dict[Path, Iterable[str]]) -> tuple[list[str], list[str]]:
        """(one line per way the shards differ from the index, the tensors it lists that are not
        where it says), given the tensors each shard file that exists holds (`held`, by relative
        path; files the index does not list are not its business). A missing shard is named as a
        missing file, with how many of the listed tensors it took along."""
        root, lines, missing = self.path.parent, [], []
        for shard in self.shards:  # missing files first: they say most about what went wrong
            if shard not in held:
                names = sorted(self.tensors_in(shard))
                missing += names
                lines.append(
                    f"{root / shard}: no such file; {self.path.name} lists {len(names)} tensors in it "
                    f"({_some(names)}): the download is incomplete"
                )
        for shard in self.shards:
            if shard not in held:
                continue
            wanted, have = self.tensors_in(shard), set(held[shard])
            for name in sorted(wanted - have):
                missing.append(name)
                lines.append(f"{root / shard}: tensor {name!r} is missing; {self.path.name} lists it in this file")
            for name in sorted(have - wanted):
                where = self.shard_of.get(name)
                lines.append(
                    f"{root / shard}: tensor {name!r} is not in {self.path.name}"
                    if where is None
                    else f"{root / shard}: tensor {name!r} is here, but {self.path.name} lists it in {where}"
                )
        return lines, missing

    def check_files(self) -> None:
        """Raise SourceError naming the first shard the index lists that is not there, if any."""
        missing = set(self.missing_shards())
        self.check({s: self.tensors_in(s) for s in self.shards if s not in missing})

    def check(self, held: dict[Path, Iterable[str]]) -> None:
        """Raise SourceError with the first problem (and how many more there are), if any."""
        lines, _ = self.problems(held)
        if lines:
            more = f" (and {len(lines) - 1} more problems with the shards)" if len(lines) > 1 else ""
            raise SourceError(lines[0] + more)


def _some(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... {len(names) - n} more" if len(names) > n else "")


def read_index(root: Path) -> Index | None:
    """The index of folder `root`, validated (valid JSON, a weight_map of names to shard paths that
    stay inside the folder), or None where the folder has none."""
    path = root / INDEX_NAME
    if not root.is_dir() or not path.exists():
        return None
    data = _check_index(path, root)
    return Index(path, {name: Path(shard) for name, shard in data["weight_map"].items()})


def containers_of(path: str | os.PathLike) -> tuple[Path, list[Path], list[Path]]:
    """(root, container files, other files) of a compressed folder or single container file; the
    other files are the source's (the folder's member list, compress's own, is not one of them)."""
    path = Path(path)
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder")
    if not path.is_dir():
        _check_regular(path, SourceError)
        return path.parent, [Path(path.name)], []
    files = walk(path)
    containers = [f for f in files if f.suffix == ".safetensors"]
    if not containers:
        raise SourceError(f"{path}: no compressed *.safetensors files in this folder")
    return path, containers, [f for f in files if f.suffix != ".safetensors" and f != Path(MEMBERS_NAME)]


def write_members(root: Path, containers: Iterable[Path]) -> None:
    """Record `containers` (relative to `root`, all written) as the folder's members, each with its
    header digest, in root / MEMBERS_NAME."""
    members = {str(rel): file_header_digest(root / rel) for rel in sorted(containers)}
    text = json.dumps({"format": MEMBERS_FORMAT, "containers": members}, indent=1) + "\n"
    (root / MEMBERS_NAME).write_text(text)


def read_members(root: Path) -> dict[Path, str] | None:
    """The folder's members (relative path -> header digest) as compress recorded them, or None for
    a folder without one (compressed before unweight wrote member lists). SourceError names a file
    that is not one."""
    path = root / MEMBERS_NAME
    if not root.is_dir() or not (path.exists() or path.is_symlink()):
        return None
    data = read_json(path)
    members = data.get("containers") if isinstance(data, dict) else None  # (a list, a number: refused below)
    if (
        not isinstance(data, dict)
        or data.get("format") != MEMBERS_FORMAT
        or not isinstance(members, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in members.items())
    ):
        raise SourceError(f"{path}: not an unweight member list ({MEMBERS_FORMAT}: containers and their digests)")
    for rel in members:
        if "\x00" in rel or ".." in Path(rel).parts or Path(rel).is_absolute():
            raise SourceError(f"{path}: container path {rel!r} leaves the folder or is not a path")
    return {Path(rel): digest for rel, digest in members.items()}


def member_problems(
    root: Path,
    containers: Iterable[Path],
    index: Index | None,
    whole: bool = True,
    digests: dict[Path, str] | None = None,
) -> tuple[list[str], bool]:
    """(one line per container that does not belong to the folder's model, whether the folder's
    unity was checked). `containers` are those found in the folder (`whole`), or the one file a
    reader was given (not whole: the list's other members are not looked for); `digests`, the
    header digests of those the caller has open (the header its mapping is read by: no second read
    of the file to race with a writer), the others' are read. With a member list, each must be
    one it lists, with the header digest it records (a shard of another compress or revision has
    other CRC-32s); without one (a folder compressed before member lists), unity cannot be checked, but
    a container the shard index does not list is still refused: readers would read some other
    model's file (transformers reads a model.safetensors before the index)."""
    members = read_members(root)
    lines = []
    if members is None:
        if index is not None:
            listed = set(index.shards)
            lines += [
                f"{root / rel}: a container that {INDEX_NAME} does not list, in a folder compressed without "
                f"{MEMBERS_NAME}: remove it (or compress the model again)"
                for rel in containers
                if rel not in listed
            ]
        return lines, False
    found = set(containers)
    for rel in sorted(found):
        if rel not in members:
            lines.append(
                f"{root / rel}: a container that {MEMBERS_NAME} does not list: not part of this compressed "
                "model (left from another one?); remove it"
            )
        elif ((digests or {}).get(rel) or file_header_digest(root / rel)) != members[rel]:
            lines.append(
                f"{root / rel}: not the container {MEMBERS_NAME} lists (its header differs): a file from "
                "another compress or revision of the model; download it again"
            )
    indexed = set(index.shards) if index is not None else set()  # it names its own missing shards, tensors too
    lines += [
        f"{root / rel}: no such file; {MEMBERS_NAME} lists it: the download is incomplete"
        for rel in sorted(set(members) - found - indexed)
        if whole
    ]
    return lines, True


def check_members(
    root: Path,
    containers: Iterable[Path],
    index: Index | None,
    whole: bool = True,
    digests: dict[Path, str] | None = None,
) -> bool:
    """member_problems, raised as SourceError with the first (and how many more); else whether the
    folder's unity was checked."""
    lines, vouched = member_problems(root, containers, index, whole, digests)
    if lines:
        more = f" (and {len(lines) - 1} more)" if len(lines) > 1 else ""
        raise SourceError(lines[0] + more)
    return vouched
