"""Copy each worker's log file to the launcher's terminal with a ``[rankN]: `` prefix, keeping
carriage-return updates (progress bars) intact.

torch elastic's own tailer reads the files in text mode, line by line: universal newlines turn
every ``\\r`` of a tqdm refresh into a line end and a partial line read at end-of-file gets a
prefix of its own, so a bar scrolls one prefixed line per refresh plus stray ``[rank0]:`` lines.
Here a file is read as bytes and each visible line is prefixed once:

* **on a terminal**, the first local rank's ``\\r`` is passed through and the next text starts
  with the prefix again, so an update redraws the same line (``\\r[rank0]: epoch 0: 50%|...``);
  of several refreshes read in one poll only the latest is drawn (at most one redraw per rank
  per :data:`POLL_INTERVAL_S`). The other ranks' redrawn lines are written as into a pipe (their
  final state, once, when they end): two ranks redrawing bars on one terminal would end each
  other's lines at every refresh and scroll a line per update (a 50-step bar on 2 ranks: ~50
  lines). That is the bar Accelerate's ``disable=not accelerator.is_local_main_process`` idiom
  shows; when another rank writes while a line is still open, that line is ended first, so
  ranks never write into each other's lines;
* **into a pipe or file** a line rewritten by ``\\r`` is emitted once, in its final state, when it
  ends (or when the worker's output ends), so a log grows one line per bar, not one per refresh.

A line that already starts with the rank's own ``[rankN]:`` (torch's C++ log lines,
``[rank1]:[W1127 ...] Warning: ...``, carry it once torch.distributed knows the rank) gets no
second one.

Every worker stream is a separate file: output written to two files within one poll interval is
ordered by the files' modification times (ties: an open line first), which can still misorder
output written to both within a few milliseconds. The per-rank files keep exactly what each
stream received.
"""

from __future__ import annotations

import codecs
import os
import threading
from typing import BinaryIO, TextIO

#: How often the relay looks for new output (seconds); elastic's tailer polls every 0.1 s.
POLL_INTERVAL_S = 0.02


class _Destination:
    """The launcher's stdout or stderr: whether it is a terminal (redraw) or a pipe/file."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.redraw = _is_terminal(stream)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class PrefixedStream:
    """Turns one worker's raw output into prefixed text for one destination (see the module doc).
    ``live``: on a terminal, this stream's carriage-return updates redraw in place (else they are
    written once, in their final state, as into a pipe)."""

    def __init__(self, prefix: str, destination: _Destination, *, live: bool = True) -> None:
        self.prefix, self.destination = prefix, destination
        self.redraw = destination.redraw and live
        self._own_mark = prefix.rstrip()  # "[rank1]:": torch's C++ log lines already start with it
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._line = ""  # pipe mode: the current line's latest state
        self._after_return = False  # the last character seen was "\r"
        self._at_line_start = True  # terminal mode: nothing of the current visible line written yet

    def feed(self, data: bytes, final: bool = False) -> str:
        """Text to write for ``data``; ``final`` flushes what is pending (the worker's output ended)."""
        text = self._decoder.decode(data, final)
        out = self._feed_terminal(_latest_redraws(text)) if self.redraw else self._feed_pipe(text)
        if final:
            out += self._end()
        return out

    def _feed_terminal(self, text: str) -> str:
        parts: list[str] = []
        for piece in _split_keeping_ends(text):
            if piece == "\n":
                # an empty line still shows its rank; a line just redrawn by "\r" only ends
                prefix = self.prefix if self._at_line_start and not self._after_return else ""
                parts.append(prefix + "\n")
                self._at_line_start, self._after_return = True, False
            elif piece == "\r":
                parts.append("\r")
                self._at_line_start, self._after_return = True, True
            else:
                parts.append((self._prefix_for(piece) if self._at_line_start else "") + piece)
                self._at_line_start, self._after_return = False, False
        return "".join(parts)

    def _feed_pipe(self, text: str) -> str:
        parts: list[str] = []
        for piece in _split_keeping_ends(text):
            if piece == "\n":
                parts.append(f"{self._prefix_for(self._line)}{self._line}\n")
                self._line, self._after_return = "", False
            elif piece == "\r":
                self._after_return = True
            else:
                # text after a carriage return rewrites the line: keep only its latest state
                self._line = piece if self._after_return else self._line + piece
                self._after_return = False
        return "".join(parts)

    def _prefix_for(self, line_start: str) -> str:
        """The prefix for a line beginning with ``line_start``: none when torch already put the rank's."""
        return "" if line_start.startswith(self._own_mark) else self.prefix

    def _end(self) -> str:
        if self.redraw:
            return "" if self._at_line_start else "\n"
        line, self._line = self._line, ""
        return f"{self._prefix_for(line)}{line}\n" if line else ""

    @property
    def line_open(self) -> bool:
        return self.redraw and not self._at_line_start

    def line_ended_elsewhere(self) -> None:
        """Another rank ended this stream's open line on the terminal: the next text starts a new one."""
        self._at_line_start, self._after_return = True, False


def _latest_redraws(text: str) -> str:
    """``text`` with each run of carriage-return refreshes within a line cut to its latest one
    (``"\\rbar 1\\rbar 2\\rbar 3"`` -> ``"\\rbar 3"``): a terminal would show only that one."""
    if text.count("\r") < 2:
        return text
    lines = text.split("\n")
    for index, line in enumerate(lines):
        if line.count("\r") < 2:
            continue
        head, *refreshes = line.split("\r")
        drawn = [refresh for refresh in refreshes if refresh]
        lines[index] = head + ("\r" + drawn[-1] if drawn else "") + ("\r" if line.endswith("\r") else "")
    return "\n".join(lines)


def _split_keeping_ends(text: str) -> list[str]:
    pieces: list[str] = []
    start = 0
    for index, char in enumerate(text):
        if char in "\r\n":
            if index > start:
                pieces.append(text[start:index])
            pieces.append(char)
            start = index + 1
    if start < len(text):
        pieces.append(text[start:])
    return pieces


class LogRelay:
    """Relays worker log files to the launcher's streams from :meth:`start` until :meth:`stop` has
    drained what the workers wrote. ``entries``: ``(path, prefix, stream)``.

    On a terminal only the first entry's rank (the first local rank) redraws in place.

    One thread polls every file; the new output of one round is written in the order the files
    were last modified, so lines of different ranks and streams come out in about the order
    they were written. It also tracks which stream has a line open on a terminal, so that text
    of another rank never lands inside it (stdout and stderr are usually the same terminal)."""

    def __init__(self, entries: list[tuple[str, str, TextIO]]) -> None:
        destinations: dict[int, _Destination] = {}
        live_prefix = entries[0][1] if entries else None
        self.streams = [(path, PrefixedStream(prefix, destinations.setdefault(id(stream), _Destination(stream)),
                                              live=prefix == live_prefix))
                        for path, prefix, stream in entries if path]
        self._open_line: PrefixedStream | None = None
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True, name="torchrig-log-relay")

    def start(self) -> LogRelay:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Let the relay write out what the files hold, then end."""
        self._finished.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _relay(self) -> None:
        sources: dict[int, BinaryIO] = {}
        try:
            while True:
                finished = self._finished.is_set()  # read first: the round after it drains everything
                chunks: list[tuple[int, int, bytes]] = []
                for index, (path, _) in enumerate(self.streams):
                    source = sources.get(index)
                    if source is None:
                        try:
                            source = sources[index] = open(path, "rb")
                        except FileNotFoundError:
                            continue
                    modified = os.fstat(source.fileno()).st_mtime_ns
                    data = source.read()
                    if data:
                        chunks.append((modified, index, data))
                # Modification times tick coarsely (a few ms): on a tie the stream whose line is open
                # goes first, so a bar's last refresh is not cut off by the next line of its rank.
                chunks.sort(key=lambda chunk: (chunk[0], self.streams[chunk[1]][1] is not self._open_line, chunk[1]))
                for _, index, data in chunks:
                    self._emit(self.streams[index][1], data)
                if finished:
                    for _, stream in self.streams:
                        self._emit(stream, b"", final=True)
                    return
                self._finished.wait(POLL_INTERVAL_S)
        finally:
            for source in sources.values():
                source.close()

    def _emit(self, stream: PrefixedStream, data: bytes, final: bool = False) -> None:
        text = stream.feed(data, final)
        if not text:
            return
        owner = self._open_line
        if owner is not None and owner is not stream and stream.destination.redraw:
            owner.destination.stream.write("\n")  # never write inside another rank's open line
            owner.destination.stream.flush()
            owner.line_ended_elsewhere()
            self._open_line = None
        stream.destination.stream.write(text)
        stream.destination.stream.flush()
        if stream.line_open:
            self._open_line = stream
        elif self._open_line is stream:
            self._open_line = None


__all__ = ["POLL_INTERVAL_S", "LogRelay", "PrefixedStream"]
