"""Frame content whose meaning survives lossy encoding: flat palette colours, large shapes, index barcodes.

Every frame is an RGB ``uint8`` array of shape ``(height, width, 3)``. Content uses only the eight
corners of the RGB cube, which stay far apart after YUV 4:2:0 conversion and quantisation, so a
decoded pixel region is classified back to its colour name by nearest palette colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Final, Literal, get_args

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "BARCODE_DIGITS",
    "PALETTE",
    "SATURATED_COLOURS",
    "SHAPES",
    "BarcodeError",
    "ColourName",
    "Frame",
    "ShapeName",
    "classify_colour",
    "classify_shape",
    "draw_frame_index",
    "indexed_frames",
    "read_frame_index",
    "shape_frame",
    "shape_mask",
    "solid_frame",
]

Frame = NDArray[np.uint8]
"""An RGB frame: ``uint8`` array of shape ``(height, width, 3)``."""

ColourName = Literal["black", "white", "red", "green", "blue", "yellow", "cyan", "magenta"]
ShapeName = Literal["circle", "square", "triangle"]

PALETTE: Final = MappingProxyType(
    {
        "black": (0, 0, 0),
        "white": (255, 255, 255),
        "red": (255, 0, 0),
        "green": (0, 255, 0),
        "blue": (0, 0, 255),
        "yellow": (255, 255, 0),
        "cyan": (0, 255, 255),
        "magenta": (255, 0, 255),
    }
)
"""Colour name -> RGB triple. The order of the names is the digit order of the frame-index barcode."""

SATURATED_COLOURS: Final[tuple[ColourName, ...]] = ("red", "green", "blue", "yellow", "cyan", "magenta")
"""Palette colours that are neither black nor white (used for content on a black background)."""

SHAPES: Final[tuple[ShapeName, ...]] = get_args(ShapeName)

BARCODE_DIGITS: Final = 4
"""Default number of base-8 data digits in a frame-index barcode (indices up to 8**4 - 1 = 4095)."""

_PALETTE_NAMES: Final[tuple[ColourName, ...]] = tuple(PALETTE)  # type: ignore[assignment]
_PALETTE_RGB: Final = np.array([PALETTE[name] for name in _PALETTE_NAMES], dtype=np.float64)
_BASE: Final = len(PALETTE)
# Decoded flat regions of a lossy (crf ~23, 4:2:0) encode land within ~30 of the source colour; the
# nearest wrong palette colour is at least 255 away, so 100 separates "this colour" from "not content".
_MAX_COLOUR_DISTANCE: Final = 100.0
_MIN_BLOCK_PX: Final = 8
# Encoded shapes fit their own ideal mask with intersection over union >= 0.78 (4:2:0, >= 32 px
# frames); anything below 0.7 is not one of the shapes.
_MIN_SHAPE_IOU: Final = 0.7


class BarcodeError(ValueError):
    """A frame's barcode is missing, damaged or fails its check digit."""


def _check_size(width: int, height: int) -> None:
    if width < 1 or height < 1:
        raise ValueError(f"frame size must be positive, got width={width}, height={height}")


def _rgb(colour: ColourName) -> tuple[int, int, int]:
    try:
        return PALETTE[colour]
    except KeyError:
        raise ValueError(f"unknown colour {colour!r}; known colours are {', '.join(PALETTE)}") from None


def solid_frame(colour: ColourName, *, width: int, height: int) -> Frame:
    """A frame filled with one palette colour."""
    _check_size(width, height)
    frame = np.empty((height, width, 3), dtype=np.uint8)
    frame[:] = _rgb(colour)
    return frame


def _shape_in_box(shape: ShapeName, height: int, width: int) -> NDArray[np.bool_]:
    """Mask of ``shape`` filling a ``height`` x ``width`` box (circle: inscribed ellipse; triangle:
    apex at the top centre, base along the bottom)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64) + 0.5
    if shape == "square":
        return np.ones((height, width), dtype=bool)
    if shape == "circle":
        return ((y / height - 0.5) ** 2 + (x / width - 0.5) ** 2) <= 0.25
    if shape == "triangle":
        return np.abs(x / width - 0.5) <= (y / height) / 2
    raise ValueError(f"unknown shape {shape!r}; known shapes are {', '.join(SHAPES)}")


def shape_mask(shape: ShapeName, *, width: int, height: int, scale: float = 0.7) -> NDArray[np.bool_]:
    """Boolean ``(height, width)`` mask of a shape centred in the frame.

    ``scale`` is the side of the shape's square bounding box as a fraction of the shorter frame
    side, in ``(0, 1]`` (rounded to an even number of pixels, placed at even offsets).
    """
    _check_size(width, height)
    if not 0 < scale <= 1:
        raise ValueError(f"scale must be in (0, 1], got {scale}")
    # Even size and offsets put the edges on 2x2 chroma-block boundaries, so 4:2:0 encoding does
    # not smear the shape's colour across them.
    size = max(2, 2 * int(scale * min(width, height) / 2))
    top, left = (height - size) // 4 * 2, (width - size) // 4 * 2
    mask = np.zeros((height, width), dtype=bool)
    mask[top : top + size, left : left + size] = _shape_in_box(shape, size, size)
    return mask


def shape_frame(
    shape: ShapeName,
    colour: ColourName,
    *,
    width: int,
    height: int,
    background: ColourName = "black",
    scale: float = 0.7,
) -> Frame:
    """A ``background`` frame with one large ``shape`` in ``colour`` centred on it.

    ``scale`` is as in :func:`shape_mask`.
    """
    if colour == background:
        raise ValueError(f"shape colour and background are both {colour!r}; the shape would be invisible")
    frame = solid_frame(background, width=width, height=height)
    frame[shape_mask(shape, width=width, height=height, scale=scale)] = _rgb(colour)
    return frame


def classify_colour(
    pixels: NDArray[np.uint8],
    *,
    candidates: Sequence[ColourName] | None = None,
    max_distance: float | None = _MAX_COLOUR_DISTANCE,
) -> ColourName:
    """Name the palette colour of a flat region.

    Args:
        pixels: RGB values, shape ``(..., 3)`` (a pixel, a region or a whole frame). The per-channel
            median is classified, so a few pixels of other colours do not change the answer.
        candidates: palette names to choose from; ``None`` means the whole palette.
        max_distance: largest accepted Euclidean RGB distance (0-255 scale) between the median and
            the chosen colour; ``None`` accepts any distance.

    Raises:
        ValueError: the region is empty, or no candidate is within ``max_distance``.
    """
    pixels = np.asarray(pixels)
    if pixels.ndim < 1 or pixels.shape[-1] != 3 or pixels.size == 0:
        raise ValueError(f"pixels must be a non-empty (..., 3) RGB array, got shape {pixels.shape}")
    names = tuple(candidates) if candidates is not None else _PALETTE_NAMES
    if not names:
        raise ValueError("candidates must name at least one colour")
    table = np.array([_rgb(name) for name in names], dtype=np.float64)
    median = np.median(pixels.reshape(-1, 3).astype(np.float64), axis=0)
    distances = np.linalg.norm(table - median, axis=1)
    best = int(np.argmin(distances))
    if max_distance is not None and distances[best] > max_distance:
        raise ValueError(
            f"median colour {tuple(round(v) for v in median)} is {distances[best]:.0f} away from the "
            f"nearest candidate {names[best]!r} (limit {max_distance:.0f}); the region is not flat content"
        )
    return names[best]


def classify_shape(frame: Frame, *, background: ColourName = "black") -> ShapeName | None:
    """Name the single shape drawn on a ``background`` frame, or ``None`` when the frame is empty.

    The shape's pixels are those more than half as far from ``background`` as its typical pixel
    (so blurred edges split evenly); the shape is the one whose ideal mask, fitted to their
    bounding box, overlaps them best (intersection over union).

    Raises:
        ValueError: the foreground matches no shape well (best intersection over union < 0.7).

    Reliable for shapes drawn by :func:`shape_frame` at least ~20 pixels across, encoded at even
    frame sizes or in 4:4:4; odd-size 4:2:0 encodes (e.g. ``mpeg4``) smear small shapes too much.
    """
    pixels = np.asarray(frame, dtype=np.float64)
    distance = np.linalg.norm(pixels - np.array(_rgb(background), dtype=np.float64), axis=-1)
    core = distance > _MAX_COLOUR_DISTANCE
    # Ignore isolated ringing pixels: a real shape is large.
    if core.sum() < 0.01 * core.size:
        return None
    # Half way between the background and the shape's typical colour: blurred edges split evenly.
    foreground = distance > float(np.median(distance[core])) / 2
    rows = np.flatnonzero(foreground.any(axis=1))
    cols = np.flatnonzero(foreground.any(axis=0))
    box = foreground[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1]
    scores = {}
    for shape in SHAPES:
        ideal = _shape_in_box(shape, *box.shape)
        scores[shape] = (box & ideal).sum() / (box | ideal).sum()
    best = max(scores, key=scores.__getitem__)
    if scores[best] < _MIN_SHAPE_IOU:
        detail = ", ".join(f"{shape} {score:.2f}" for shape, score in scores.items())
        raise ValueError(f"the foreground matches no known shape (intersection over union: {detail})")
    return best


def _barcode_layout(width: int, height: int, digits: int) -> tuple[int, list[tuple[int, int]]]:
    """Band height and the ``[start, stop)`` columns of each block (data digits, then the check digit)."""
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    blocks = digits + 1
    band = max(_MIN_BLOCK_PX, height // 8)
    if width < blocks * _MIN_BLOCK_PX or height < band:
        raise ValueError(
            f"a {digits}-digit barcode needs at least {blocks * _MIN_BLOCK_PX}x{_MIN_BLOCK_PX} pixels "
            f"(width x height), got {width}x{height}"
        )
    edges = np.linspace(0, width, blocks + 1).round().astype(int)
    return band, [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]


def draw_frame_index(frame: Frame, index: int, *, digits: int = BARCODE_DIGITS) -> Frame:
    """Return a copy of ``frame`` with ``index`` encoded in a colour barcode along its top edge.

    The top band (``max(8, height // 8)`` rows) is split into ``digits + 1`` equal blocks. Block
    ``i`` holds the ``i``-th base-8 digit of ``index`` (most significant first) as the palette
    colour at that position in :data:`PALETTE`; the last block holds the digit sum modulo 8, so a
    damaged, cropped or rotated barcode is detected instead of misread.
    """
    frame = np.asarray(frame)
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
        raise ValueError(f"frame must be a uint8 (height, width, 3) array, got {frame.dtype} {frame.shape}")
    capacity = _BASE**digits
    if not 0 <= index < capacity:
        raise ValueError(f"index {index} does not fit a {digits}-digit barcode (0 <= index < {capacity})")
    band, blocks = _barcode_layout(frame.shape[1], frame.shape[0], digits)
    values = [(index // _BASE**power) % _BASE for power in reversed(range(digits))]
    values.append(sum(values) % _BASE)
    out = frame.copy()
    for (start, stop), value in zip(blocks, values, strict=True):
        out[:band, start:stop] = _PALETTE_RGB[value].astype(np.uint8)
    return out


def read_frame_index(frame: Frame, *, digits: int = BARCODE_DIGITS) -> int:
    """Decode the index written by :func:`draw_frame_index` from a (possibly lossy-decoded) frame.

    Each block is classified from its interior (a quarter of the block size is trimmed from every
    side, away from chroma bleeding at block edges).

    Raises:
        BarcodeError: a block is not a palette colour, or the check digit does not match.
    """
    frame = np.asarray(frame)
    if frame.ndim != 3 or frame.shape[2] != 3:
        raise ValueError(f"frame must be a (height, width, 3) array, got shape {frame.shape}")
    band, blocks = _barcode_layout(frame.shape[1], frame.shape[0], digits)
    values = []
    for position, (start, stop) in enumerate(blocks):
        dy, dx = band // 4, (stop - start) // 4
        region = frame[dy : band - dy, start + dx : stop - dx]
        try:
            values.append(_PALETTE_NAMES.index(classify_colour(region)))
        except ValueError as error:
            raise BarcodeError(f"barcode block {position} is unreadable: {error}") from error
    *data, check = values
    if sum(data) % _BASE != check:
        raise BarcodeError(f"barcode check digit {check} does not match digits {data}")
    index = 0
    for value in data:
        index = index * _BASE + value
    return index


def indexed_frames(num_frames: int, *, width: int, height: int, digits: int = BARCODE_DIGITS) -> list[Frame]:
    """Frames that identify themselves: frame ``i`` is filled with ``SATURATED_COLOURS[i % 6]`` and
    carries ``i`` in its barcode (:func:`draw_frame_index`).

    The barcode covers only the top eighth, so :func:`classify_colour` of a whole frame still names
    its fill colour.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames must be >= 1, got {num_frames}")
    return [
        draw_frame_index(
            solid_frame(SATURATED_COLOURS[i % len(SATURATED_COLOURS)], width=width, height=height),
            i,
            digits=digits,
        )
        for i in range(num_frames)
    ]
