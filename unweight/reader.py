"""Reading compressed checkpoints tensor by tensor: lazily, from memory-mapped containers."""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from unweight.codec import check_stream_crcs, checksum
from unweight.codec import transposed as coded_transposed
from unweight.codec.pieces import decode_pieces
from unweight.errors import CorruptDataError, FormatError, SourceError
from unweight.formats import ContainerReader, TensorEntry
from unweight.formats.dtypes import DTYPE_SIZES, TORCH_DTYPES

from .decoding import decode_one
from .folder import check_members, containers_of, read_index
from .memory import PIECE_BYTES, check_budget, require

# safetensors dtype -> torch dtype name (resolved lazily: torch loads only when a tensor is asked for)


@dataclass
class IntegrityStats:
    """What a CompressedCheckpoint has checked so far, and what the checks that decode nothing
    else cost. Every tensor it hands out is checked once: `streams` by the CRC-32s of the stored
    streams (format 1.1), or for a 1.0 container by a decode and the CRC-32 of the original bytes;
    `get_bytes`/`get_tensor` by the decode's CRC-32 of the original bytes."""

    by_stream_crc: int = 0  # tensors whose stored streams matched their CRC-32s
    stream_bytes: int = 0  # the bytes those CRCs covered
    by_decode: int = 0  # tensors decoded only to check them (1.0 containers, no stream CRCs)
    decoded_bytes: int = 0  # the original bytes of those
    seconds: float = 0.0  # time spent in these two checks (not in decodes done for the data itself)
    decoded: int = 0  # tensors decoded for their data by get_bytes/get_tensor (CRC-32 included)


class CompressedCheckpoint:
    """A compressed folder or container file; tensors are decoded on demand, by name.

    >>> ckpt = CompressedCheckpoint("out-dir")
    >>> w = ckpt.get_tensor("model.layers.0.mlp.up_proj.weight")   # a torch.Tensor, bit-exact
    """

    def __init__(self, path: str | os.PathLike, threads: int | None = None, max_memory: int | None = None):
        self.path = Path(path)
        self.threads = threads
        self.max_memory = check_budget(max_memory)  # a tensor asked for whole must fit (else MemoryLimitError)
        root, files, _ = containers_of(self.path)
        # A sharded folder is read as its index lists it (as transformers and vLLM read one): only
        # the shards it names, and only once they hold exactly the tensors it says. And a folder is
        # one model: every container in it one that compress wrote with the others (its member list),
        # none of another model or revision. `vouched` says whether a member list checked that.
        self.index = read_index(root) if self.path.is_dir() else None
        found = files
        if self.index is not None:
            self.index.check_files()
            files = self.index.shards
        self._readers: dict[str, ContainerReader] = {}
        self._where: dict[str, str] = {}
        self.integrity = IntegrityStats()
        self._checked: set[str] = set()  # tensors whose streams passed their check (the mapping is read-only)
        self._decoded: set[str] = set()  # tensors decoded whole, which checks the CRC-32 of their bytes
        self._slab_crcs: dict[str, tuple[int, int]] = {}  # name -> (next whole slab, running CRC-32 of those before)
        try:
            for rel in files:
                reader = ContainerReader(root / rel)
                self._readers[str(rel)] = reader
                for name in reader.tensors:
                    if name in self._where:
                        raise SourceError(f"{self.path}: tensor {name!r} is in both {self._where[name]} and {rel}")
                    self._where[name] = str(rel)
            digests = {Path(rel): r.header_digest for rel, r in self._readers.items()}
            self.vouched = check_members(root, found, self.index, self.path.is_dir(), digests)
            if self.index is not None:
                self.index.check({Path(rel): reader.tensors for rel, reader in self._readers.items()})
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def entry(self, name: str) -> TensorEntry:
        return self._reader(name).tensors[name]

    def _reader(self, name: str) -> ContainerReader:
        if name not in self._where:
            raise KeyError(f"no tensor {name!r} in {self.path}")
        return self._readers[self._where[name]]

    def streams(self, name: str, check: bool = True) -> dict[str, np.ndarray]:
        """The tensor's stored streams by role, undecoded (read-only views of the mapping).

        With `check` (the default) they are checked the first time they are asked for: against
        their CRC-32s, or, in a 1.0 container that has none, by decoding the tensor once and
        checking the CRC-32 of its original bytes. Raises CorruptDataError naming the file and
        tensor. A caller that decodes the tensor itself with the CRC check (decode_tensor's
        default) may pass check=False."""
        reader = self._reader(name)
        entry = reader.tensors[name]
        streams = reader.streams_of(entry)
        if check and name not in self._checked:
            t0, st = time.perf_counter(), self.integrity
            nbytes = check_stream_crcs(entry, streams, reader.path)
            if nbytes >= 0:
                st.by_stream_crc += 1
                st.stream_bytes += nbytes
            else:  # decoded in pieces: the check needs no memory of the tensor's size
                try:
                    for _ in decode_pieces(entry, streams, PIECE_BYTES, self.threads):
                        pass
                except FormatError as e:
                    raise type(e)(reader.path, e.reason, name) from None
                st.by_decode += 1
                st.decoded_bytes += entry.nbytes
            st.seconds += time.perf_counter() - t0
            self._checked.add(name)
        return streams

    def file_of(self, name: str) -> str:
        """The path of the container file that holds tensor `name`."""
        return self._reader(name).path

    def get_bytes(self, name: str) -> np.ndarray:
        """The tensor's original bytes (uint8, C order), CRC-checked."""
        self.integrity.decoded += 1
        data = decode_one(self._reader(name), name, self.threads, self.max_memory)
        self._decoded.add(name)
        return data

    def checked_tensors(self) -> int:
        """How many distinct tensors have been checked so far: by their streams' CRC-32s, or by the
        CRC-32 of their bytes decoded whole."""
        return len(self._checked | self._decoded)

    def decoded_tensors(self) -> int:
        """How many distinct tensors have been decoded whole so far (at once, or slab by slab in
        order), which checked the CRC-32 of their original bytes."""
        return len(self._decoded)

    def get_tensor(self, name: str):
        """The tensor as a torch.Tensor with its original dtype and shape (CPU, bit-exact)."""
        import torch

        e = self.entry(name)
        dtype = self.torch_dtype(name)
        data = self.get_bytes(name)
        if e.numel == 0:  # strides of an empty tensor may pass int64 ([0, 2^47, 2^47, 2^47]): reshape keeps them 0
            try:
                return torch.empty(0, dtype=dtype).reshape(e.shape)
            except RuntimeError as err:  # a shape torch cannot represent: say which file and tensor
                raise FormatError(
                    self._reader(name).path, f"torch cannot hold an empty tensor of shape {list(e.shape)} ({err})", name
                ) from None
        if not data.flags.writeable:
            data = data.copy()  # raw-coded tensors are views of the read-only mapping
        return torch.from_numpy(data).view(dtype).reshape(e.shape)

    def get_rows(self, name: str, start: int, stop: int, slab: int | None = None, transposed: bool = False):
        """Rows [start, stop) of the tensor's first dimension as a torch.Tensor (CPU, bit-exact),
        decoding only what holds them where the codec allows (rans chunks, tiles rows): a tensor-
        parallel rank's rows without the whole tensor. With `slab`, rows [start, stop) of its second
        dimension within index `slab` of the first (`t[slab, start:stop]` of a tensor of three or more
        dimensions): a rank's rows of one expert of a fused experts tensor; with `transposed` too,
        rows of that expert's matrix transposed (`t[slab].T[start:stop]`, contiguous), which decode
        alone where the tensor is coded transposed (Llama 4's gate_up), else from the whole matrix.
        The streams are checked first (streams())."""
        import torch

        from unweight.codec import decode_rows

        if transposed:
            return self._transposed_rows(name, start, stop, slab)
        if slab is not None and coded_transposed(self.entry(name)):
            return self._transposed_rows(name, 0, self.entry(name).shape[2], slab)[:, start:stop].t().contiguous()
        e, base = self._row_view(name, slab)
        dtype = self.torch_dtype(name)
        shape = self.entry(name).shape if slab is None else self.entry(name).shape[1:]
        span, rest = (shape[0], shape[1:]) if shape else (0, ())
        if not 0 <= start <= stop <= span:
            raise ValueError(f"rows [{start}, {stop}) lie outside tensor {name!r}'s {span}")
        if start == stop or e.numel == 0:
            return torch.empty((stop - start, *rest), dtype=dtype)
        if slab is not None and e.codec != "rans":  # no part decodes alone: the whole, CRC-32 checked
            return self.get_tensor(name)[slab, start:stop].clone()
        require(
            self.rows_memory(name, stop - start, slab is not None),
            self.max_memory,
            "decoding these rows",
            self.file_of(name),
            name,
        )
        streams = self.streams(name)
        try:
            data = decode_rows(e, streams, np.arange(base + start, base + stop), self.threads)
        except FormatError as err:
            raise type(err)(self.file_of(name), err.reason, name) from None
        self.integrity.decoded += 1
        data = np.ascontiguousarray(data)
        if slab is not None and (start, stop) == (0, span):
            self._slab_crc(name, slab, data)
        return torch.from_numpy(data).view(dtype).reshape(stop - start, *rest)

    def _transposed_rows(self, name: str, start: int, stop: int, slab: int | None):
        """get_rows(..., transposed=True): `t[slab].T[start:stop]` as a contiguous tensor."""
        import torch

        from unweight.codec import decode_rows

        e = self.entry(name)
        if slab is None or len(e.shape) != 3 or not 0 <= slab < e.shape[0]:
            raise ValueError(f"tensor {name!r} of shape {list(e.shape)} has no matrix {slab} to transpose")
        _, height, width = e.shape
        if not 0 <= start <= stop <= width:
            raise ValueError(f"rows [{start}, {stop}) lie outside tensor {name!r}'s transposed {width}")
        if not coded_transposed(self.entry(name)):  # the matrix whole (CRC-checked in order), then its columns
            return self.get_rows(name, 0, height, slab)[:, start:stop].t().contiguous()
        dtype = self.torch_dtype(name)
        if start == stop:
            return torch.empty(0, height, dtype=dtype)
        require(
            self.rows_memory(name, stop - start, transposed=True),
            self.max_memory,
            "decoding these rows",
            self.file_of(name),
            name,
        )
        streams = self.streams(name)
        coded = dataclasses.replace(  # its coded order: (E * width, height), untransposed
            e, shape=(e.shape[0] * width, height), params={k: v for k, v in e.params.items() if k != "transpose"}
        )
        try:
            data = decode_rows(coded, streams, np.arange(slab * width + start, slab * width + stop), self.threads)
        except FormatError as err:
            raise type(err)(self.file_of(name), err.reason, name) from None
        self.integrity.decoded += 1
        data = np.ascontiguousarray(data)
        if (start, stop) == (0, width):  # the whole matrix: the tensor's CRC-32 goes on, over its original bytes
            self._slab_crc(name, slab, np.ascontiguousarray(data.view(f"u{DTYPE_SIZES[e.dtype]}").T).view(np.uint8))
        return torch.from_numpy(data).view(dtype).reshape(stop - start, height)

    def _slab_crc(self, name: str, slab: int, data: np.ndarray) -> None:
        """Continues the CRC-32 of tensor `name` over its whole slabs decoded in order (`data` is
        slab `slab`), and checks it once the last one is in: a tensor decoded slab by slab (a fused
        experts tensor, one expert at a time) is checked as a tensor decoded whole is."""
        following, crc = self._slab_crcs.pop(name, (0, 0))
        if slab != following:  # out of order: this tensor is checked by its streams' CRC-32s only
            return
        crc = checksum.crc32(data, crc)
        e = self.entry(name)
        if slab + 1 < e.shape[0]:
            self._slab_crcs[name] = (slab + 1, crc)
        elif crc != e.crc32:
            raise CorruptDataError(
                self.file_of(name), "decoded bytes fail the CRC-32 check (the file is damaged)", name
            )
        else:
            self._decoded.add(name)

    def _row_view(self, name: str, slab: int | None) -> tuple[TensorEntry, int]:
        """The entry whose rows get_rows decodes, and the first row of `slab`: the tensor's own, or
        for a slab of a rans tensor its first two dimensions as one (the same elements in the same
        order, so the same chunks hold them)."""
        e = self.entry(name)
        if slab is None:
            return e, 0
        if len(e.shape) < 3 or not 0 <= slab < e.shape[0]:
            raise ValueError(f"tensor {name!r} of shape {list(e.shape)} has no slab {slab} with rows")
        if e.codec != "rans":
            return e, 0
        flat = dataclasses.replace(e, shape=(e.shape[0] * e.shape[1], *e.shape[2:]))
        return flat, slab * e.shape[1]

    def rows_memory(self, name: str, rows: int, in_slab: bool = False, transposed: bool = False) -> int:
        """The bytes get_rows allocates for `rows` rows of tensor `name` (of dim 1, `in_slab`; of a
        matrix transposed, `transposed`): the rows, the whole matrix where the tensor is not coded
        in the rows' order, or the whole tensor where its codec decodes no part of one alone (raw,
        zstd)."""
        e = self.entry(name)
        if e.codec not in ("rans", "tiles") or not e.shape:
            return e.nbytes
        if len(e.shape) == 3 and (in_slab or transposed) and transposed != coded_transposed(self.entry(name)):
            return e.nbytes // max(1, e.shape[0])  # its matrix, whole
        if transposed:
            return e.nbytes // max(1, e.shape[0] * e.shape[2]) * rows
        per = e.shape[0] * (e.shape[1] if in_slab and len(e.shape) > 1 else 1)
        return e.nbytes // max(1, per) * rows

    def torch_dtype(self, name: str):
        import torch

        e = self.entry(name)
        dtype = getattr(torch, TORCH_DTYPES.get(e.dtype, ""), None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"{self._reader(name).path}: tensor {name!r} is {e.dtype}, which this torch ({torch.__version__}) has "
                f"no dtype for; get_bytes() gives its bytes"
            )
        return dtype

    def __getitem__(self, name: str):
        return self.get_tensor(name)

    @property
    def stored_bytes(self) -> int:
        return sum(r.file_size for r in self._readers.values())

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self) -> CompressedCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
