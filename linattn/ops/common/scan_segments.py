"""Segmented state scans: cutting long sequences so that a chunked scan's critical path is not the longest one.

A chunked Triton scan runs one program per (value block, key block, sequence, head) over that sequence's chunks, one
after another. When a few sequences are much longer than the rest (packed documents of 64 to 4096 tokens), or there
are few of them (one sequence of 32768 tokens: 8 heads x 4 blocks = 32 programs on 132 SMs, 512 chunks each), the
longest sequence sets the scan's time while most of the GPU waits. With a diagonal transition (a decay per key
channel, or a scalar decay) a sequence can be cut into segments that run at once: each segment scans its chunks from
a zero state (the sequence's first segment from its initial state), keeping its end state E_j and its summed log
decay Lambda_j, and the state entering segment j is then the fold

    S_j = exp(Lambda_{j-1}) * S_{j-1} + E_{j-1},     S_first = 0 (its E already holds the initial state),

after which every chunk-entry state of segment j gains exp(lambda_n) * S_j (lambda_n: the log decay from the
segment's start to chunk n's, kept per chunk by the scan). The reverse scan of state gradients is the mirror image.
The fold and the corrections run in one more kernel (common/triton_scan_segments.py).

This module plans the segments on the host: their length in chunks is the work per scan slot of the GPU, at least
``min_chunks``, so that segments neither leave the GPU idle nor add fix-up work where the scan already fills it.
Unpacked batches are cut by arithmetic (every row alike, nothing stored); packed sequences get a table built from
the offsets the host already holds, kept on the chunk layout's ``cu_chunks`` tensor so that the backward pass
(which runs outside the packed call and has no offsets) finds the same table; where it does not, the backward pass
scans unsegmented, which gives the same numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .packed_call import current_packing, kept

# Programs of a scan resident on one SM at a time: the scans' float32 state tiles and pipelined loads leave room
# for about two (an estimate; it sets only how long segments are)
SLOTS_PER_SM = 2
# SMs assumed where the device reports none (Triton's interpreter on the CPU): an H100's, so that "auto" plans on the
# CPU as on that GPU
DEFAULT_SMS = 132
MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class Segments:
    """The segments of a scan. ``count`` segments in all; unpacked (``table`` None): every batch row cut into
    ``per_row`` segments of ``length`` chunks (the last one holding what remains); packed: ``table`` [count, 5]
    int32 on the device, per segment its first chunk, the chunk after its last, its sequence, and the indices of its
    sequence's first and last segments."""

    count: int
    length: int
    per_row: int = 0
    table: torch.Tensor | None = None


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def segment_length(chunks: int, programs_per_chunk: int, device: torch.device, min_chunks: int) -> int:
    """Chunks per segment: the scan's work (``chunks`` of all sequences times the programs each chunk column runs)
    spread over the GPU's scan slots, at least ``min_chunks``."""
    slots = SLOTS_PER_SM * _sm_count(torch.device(device))
    return max(min_chunks, -(-chunks * programs_per_chunk // slots))


# "auto" cuts sequences longer than this many segment lengths: a scan whose longest sequence is shorter is within
# this factor of the best it could do, and the fix-up kernel and its extra reads are not free. 2, not less: on an H200
# simple_gla's forward and backward at B 8, T 2048, H 8 (longest 32 chunks, segments of 16) took 1.50 ms cut in two
# against 1.21 uncut, while 2 x 8192 (128 chunks, segments of 16) and 1 x 32768 gained
AUTO_FACTOR = 2.0


def _worth_it(longest: int, length: int, mode: str) -> bool:
    """"always": whenever the longest sequence spans more than one segment; "auto": when it spans more than
    AUTO_FACTOR segment lengths (``mode`` one of MODES, checked by :func:`plan_segments`)."""
    return mode != "never" and longest > (length if mode == "always" else AUTO_FACTOR * length)


def _even_split(n: int, length: int) -> tuple[int, int]:
    """(pieces, size): n chunks cut into pieces of at most ``length`` chunks, as even as the chunks allow and with no
    empty piece."""
    size = -(-n // -(-n // length))
    return -(-n // size), size


@functools.lru_cache(maxsize=256)
def unpacked_segments(B: int, NC: int, programs_per_chunk: int, device: torch.device, min_chunks: int,
                      mode: str = "auto") -> Segments | None:
    """The segments of B rows of NC chunks each, or None where an unsegmented scan is as fast (kept per arguments:
    a training step asks the same question a few times a layer)."""
    length = segment_length(B * NC, programs_per_chunk, device, min_chunks)
    if not _worth_it(NC, length, mode):
        return None
    per_row, length = _even_split(NC, length)
    return Segments(count=B * per_row, length=length, per_row=per_row)


def packed_segments(cu_chunks: torch.Tensor, offsets: tuple[int, ...] | None, C: int, chunks: int,
                    programs_per_chunk: int, min_chunks: int, mode: str = "auto") -> Segments | None:
    """The segments of packed sequences (``cu_chunks`` of common/packed_call.py's ChunkLayout: ``chunks`` chunks of C
    tokens in all), or None where an unsegmented scan is as fast. ``offsets``: the sequences' token offsets as read
    on the host (the forward pass); None (the backward pass): the table the forward pass kept on ``cu_chunks``, or
    None if there is none."""
    key = ("scan_segments", C, chunks, programs_per_chunk, min_chunks, mode)

    def make() -> Segments | None:
        if offsets is None:
            return None
        counts = [-(-(e - s) // C) for s, e in zip(offsets[:-1], offsets[1:], strict=True)]
        if len(counts) != cu_chunks.shape[0] - 1 or sum(counts) != chunks:  # offsets other than cu_chunks' own
            raise RuntimeError(f"packed_segments: {len(counts)} sequences of {sum(counts)} chunks in the offsets, "
                               f"{cu_chunks.shape[0] - 1} of {chunks} in cu_chunks")
        length = segment_length(sum(counts), programs_per_chunk, cu_chunks.device, min_chunks)
        if not _worth_it(max(counts), length, mode):
            return None
        rows, start = [], 0
        for seq, n in enumerate(counts):
            pieces, size = _even_split(n, length)
            first = len(rows)
            rows += [[start + j * size, min(start + (j + 1) * size, start + n), seq, first, first + pieces - 1]
                     for j in range(pieces)]
            start += n
        table = torch.tensor(rows, dtype=torch.int32)
        if cu_chunks.device.type == "cuda":  # through pinned memory without blocking (no synchronisation)
            table = table.pin_memory().to(cu_chunks.device, non_blocking=True)
        else:
            table = table.to(cu_chunks.device)
        return Segments(count=len(rows), length=length, table=table)

    return kept(cu_chunks, key, make)


def segment_buffers(segments: Segments | None, final: torch.Tensor, B: int, N: int, H: int, K: int, V: int,
                    per_key: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A segmented scan's outputs beside its chunk states, float32: the segments' end states [count, H, K, V], their
    summed log decays [count, H(, K)] and the chunks' log decays from their segment's start or end [B, H, N(, K)]
    (``per_key``: a decay per key channel, else one per head). Unsegmented: the scan writes its sequences' ``final``
    states itself and reads no decays (``final`` three times)."""
    if segments is None:
        return final, final, final
    f32, keys, device = torch.float32, ((K,) if per_key else ()), final.device
    return (torch.empty(segments.count, H, K, V, device=device, dtype=f32),
            torch.empty(segments.count, H, *keys, device=device, dtype=f32),
            torch.empty(B, H, N, *keys, device=device, dtype=f32))


def segment_table(segments: Segments | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The kernels' ``seg`` argument: the packed table, else ``placeholder`` (a pointer never read)."""
    return placeholder if segments is None or segments.table is None else segments.table


def segment_ints(segments: Segments | None) -> dict[str, int]:
    """The kernels' PER_ROW and LEN arguments (unpacked segments; 1 where unused)."""
    if segments is None:
        return {"PER_ROW": 1, "LEN": 1}
    return {"PER_ROW": max(segments.per_row, 1), "LEN": segments.length}


def plan_segments(B: int, N: int, C: int, programs_per_chunk: int, device: torch.device,
                  cu_chunks: torch.Tensor | None, launch: dict, family: str) -> Segments | None:
    """How a family's state scans are cut, from its launch settings ``segments`` (mode) and ``seg_min``: B rows of N
    chunks of C tokens (unpacked), or packed sequences (``cu_chunks``, N chunks in all; planned in the forward pass,
    which runs inside the packed call and reads its offsets, and found on ``cu_chunks`` by the backward pass)."""
    mode = launch["segments"]
    if mode not in MODES:
        raise ValueError(f"{family} launch setting segments must be one of {', '.join(map(repr, MODES))}, "
                         f"got {mode!r}")
    if cu_chunks is None:
        return unpacked_segments(B, N, programs_per_chunk, device, launch["seg_min"], mode)
    packing = current_packing()
    return packed_segments(cu_chunks, None if packing is None else packing.offsets, C, N, programs_per_chunk,
                           launch["seg_min"], mode)
