"""TinyStories-format text, streamed: never the whole file in memory.

Layouts as published: `TinyStories*-train.txt` (stories separated by `<|endoftext|>`), JSON (a list of objects)
or JSONL with a `text` field ("story" is accepted too), and parquet with a `text` column. A directory means every
such file in it, in name order. `PackedStream` turns stories into fixed-length token rows for training and can
stop and resume at an exact position.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

EOT = "<|endoftext|>"
TEXT_FIELDS = ("text", "story")
SUFFIXES = (".txt", ".json", ".jsonl", ".parquet")
_READ_CHUNK = 1 << 20


def data_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in SUFFIXES)
    elif path.exists():
        files = [path]
    else:
        raise ValueError(f"data={str(path)!r} does not exist")
    if not files or any(f.suffix not in SUFFIXES for f in files):
        raise ValueError(f"data={str(path)!r}: expected {', '.join(SUFFIXES)} files")
    return files


def read_stories(path: str | Path) -> Iterator[str]:
    """Every non-empty story, stripped, in file order."""
    for file in data_files(path):
        reader = {".txt": _read_txt, ".json": _read_json, ".jsonl": _read_jsonl, ".parquet": _read_parquet}
        for story in reader[file.suffix](file):
            story = story.strip()
            if story:
                yield story


def _read_txt(file: Path) -> Iterator[str]:
    buffer = ""
    with file.open(encoding="utf-8") as f:
        while chunk := f.read(_READ_CHUNK):
            buffer += chunk
            *stories, buffer = buffer.split(EOT)
            yield from stories
    yield buffer


def _text_of(record: dict, file: Path) -> str:
    for name in TEXT_FIELDS:
        if name in record:
            return record[name]
    raise ValueError(f"data={str(file)!r}: record without a 'text' field")


def _read_jsonl(file: Path) -> Iterator[str]:
    with file.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield _text_of(json.loads(line), file)


def _read_json(file: Path) -> Iterator[str]:
    # The published JSON shards are lists of records; a JSON-lines file saved as .json is accepted too.
    with file.open(encoding="utf-8") as f:
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
    if first != "[":
        yield from _read_jsonl(file)
        return
    for record in json.loads(file.read_text(encoding="utf-8")):
        yield _text_of(record, file)


def _read_parquet(file: Path) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(f"data={str(file)!r}: reading parquet needs pyarrow: pip install 'pagellm[parquet]'") from exc

    parquet = pq.ParquetFile(file)
    column = next((name for name in TEXT_FIELDS if name in parquet.schema_arrow.names), None)
    if column is None:
        raise ValueError(f"data={str(file)!r}: no 'text' column")
    for batch in parquet.iter_batches(columns=[column], batch_size=1024):
        yield from batch.column(0).to_pylist()


def is_validation(index: int, every: int) -> bool:
    """A fixed, content-independent split: every `every`-th story is held out."""
    return index % every == 0


@dataclass
class StreamState:
    epoch: int = 0
    story_index: int = 0  # stories of this epoch already read (training and validation alike)
    buffer: list[int] = field(default_factory=list)  # tokens read but not yet emitted


class PackedStream:
    """Rows of `row_len` token ids packed from consecutive stories (each ending in EOS), cycling over the data
    for as many epochs as asked; its state is enough to resume exactly."""

    def __init__(
        self,
        path: str | Path,
        encode: Callable[[str], list[int]],
        eos_id: int,
        row_len: int,
        split: str,
        val_every: int,
        state: StreamState | None = None,
    ) -> None:
        self.path, self.encode, self.eos_id, self.row_len = path, encode, eos_id, row_len
        self.split, self.val_every = split, val_every
        self.state = state or StreamState()
        self._stories: Iterator[tuple[int, str]] | None = None

    def _open(self) -> Iterator[tuple[int, str]]:
        stories = enumerate(read_stories(self.path))
        for _ in range(self.state.story_index):  # fast-forward to the saved position
            next(stories, None)
        return stories

    def next_row(self) -> list[int]:
        st = self.state
        while len(st.buffer) < self.row_len:
            if self._stories is None:
                self._stories = self._open()
            item = next(self._stories, None)
            if item is None:
                if st.story_index == 0:
                    raise ValueError(f"data={str(self.path)!r} has no {self.split} stories")
                st.epoch, st.story_index, self._stories = st.epoch + 1, 0, None
                continue
            index, story = item
            st.story_index = index + 1
            if is_validation(index, self.val_every) == (self.split == "val"):
                st.buffer.extend(self.encode(story) + [self.eos_id])
        row, st.buffer = st.buffer[: self.row_len], st.buffer[self.row_len :]
        return row

    def state_dict(self) -> dict:
        return asdict(self.state)

    @classmethod
    def state_from_dict(cls, d: dict) -> StreamState:
        return StreamState(**d)
