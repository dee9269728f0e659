"""An image folder's files and classes: listed, header-checked, and split into train /
validation / test.

A folder holds one sub-folder per class (sorted names are the classes); images may sit in nested
folders below a class folder. `scan` lists the files and checks each one's header (Pillow's
`Image.open`, no pixel decoding); `layout` finds or makes the train / validation / test split.

Bad data, decided once:
  - a file whose suffix is not in IMAGE_EXTENSIONS, or whose header Pillow cannot read (corrupt,
    truncated before its size, not an image): skipped at scan and listed in `Folder.skipped`
    with the reason; hidden files (".name") are ignored;
  - a link to a folder is followed, unless that folder is above it or was listed already (a loop,
    or a second name for it): skipped, so each image is listed once within its class;
  - one file reached under two classes (a class folder that is a link to the dataset's folder or
    into another class, a linked or hard-linked file): a one-line MeshfitError, since an image
    has one class;
  - a missing folder, no class folders, a class folder left with no readable image, or a single
    class: a one-line MeshfitError saying what to do.
A file whose header reads but whose pixels do not decode is an error when its batch is decoded
(meshfit.data.image_files); the batches streamed from a Folder: meshfit.data.folders.
"""

from __future__ import annotations

import concurrent.futures
import os
import warnings
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from meshfit.data.image_files import default_workers, header_problem
from meshfit.errors import MeshfitError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
SPLIT_NAMES = {"train": ("train",), "validation": ("val", "validation"), "test": ("test",)}


@dataclass(frozen=True, eq=False)
class Folder:
    """The images of a folder of class sub-folders.

    root: absolute path scanned; class_names: sorted class folder names; files: absolute paths
    sorted by (class, path in the class folder); labels: int32 (N,) indices into class_names;
    skipped: (path, reason) of the files left out at scan (a subset keeps its parent's).
    """

    root: str
    class_names: tuple[str, ...]
    files: tuple[str, ...]
    labels: np.ndarray
    skipped: tuple[tuple[str, str], ...] = ()

    def __len__(self) -> int:
        return len(self.files)

    def subset(self, indices: Sequence[int]) -> "Folder":
        """The same classes with only the files at `indices` (in that order)."""
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        return Folder(self.root, self.class_names, tuple(self.files[i] for i in indices),
                      self.labels[indices], self.skipped)


def check_folder(path: str | os.PathLike) -> str:
    """`path` made absolute; a MeshfitError where it is not a folder (`--data` is checked so before
    the devices connect)."""
    root = os.path.abspath(os.fspath(path))
    if not os.path.isdir(root):
        raise MeshfitError(f"image folder {root} does not exist or is not a folder; give a folder "
                           "with one sub-folder of images per class")
    return root


def scan(path: str | os.PathLike, class_names: tuple[str, ...] | None = None,
         training: bool = True) -> Folder:
    """The image files of `path`, one sub-folder per class; header-checked (see the module docstring).

    class_names: the classes this folder must have (a test/ or val/ folder next to train/).
    training: False for a folder a trained model is scored on, which may hold a single class.
    """
    root = check_folder(path)
    classes = tuple(sorted(d.name for d in os.scandir(root) if d.is_dir() and not d.name.startswith(".")))
    if not classes:
        raise MeshfitError(f"{root} has no class sub-folders; put each class's images in "
                           f"{root}/<class name>/")
    if class_names is not None and classes != tuple(class_names):
        raise MeshfitError(f"{root} has the class folders {', '.join(classes)} but the training "
                           f"folder has {', '.join(class_names)}; use the same class sub-folders")
    if len(classes) == 1 and training:
        raise MeshfitError(f"{root} has a single class folder ({classes[0]}); a classifier needs "
                           f"at least two: put each class's images in its own sub-folder of {root}")
    files, labels, identities, skipped = [], [], [], []
    for label, name in enumerate(classes):
        found, left_out = _class_files(os.path.join(root, name))
        if not found:
            why = f" ({len(left_out)} file(s) skipped: unreadable or not images)" if left_out else ""
            raise MeshfitError(f"class folder {os.path.join(root, name)} has no readable images{why}; "
                               f"add {', '.join(IMAGE_EXTENSIONS)} files or remove the folder")
        files += [path for path, _ in found]
        identities += [identity for _, identity in found]
        labels += [label] * len(found)
        skipped += left_out
    _check_one_class_each(files, labels, identities, classes)
    if skipped:
        images = [(p, why) for p, why in skipped if why.startswith("unreadable")]
        path, why = (images or skipped)[0]
        warnings.warn(f"skipped {len(skipped)} file(s) of {root} that are not readable images "
                      f"({len(images)} unreadable image(s)); e.g. {path}: {why}", stacklevel=2)
    return Folder(root, classes, tuple(files), np.asarray(labels, dtype=np.int32), tuple(skipped))


def _class_files(folder: str) -> tuple[list[tuple[str, tuple[int, int]]], list[tuple[str, str]]]:
    """(readable image files with their (device, inode), skipped (path, reason)) under one class
    folder, sorted by path."""
    candidates, skipped = [], []
    # Links are followed (a class folder may be a link to where its images are), but not into a
    # folder this walk has been in or one above the class folder: os.walk keeps no such record, and
    # a link back up (`ln -s .. all`) was walked again and again until the path grew too long, each
    # pass listing the images once more, those of other classes too under this class's label.
    seen = set(_real_ancestors(folder))  # and each folder as it is queued for the walk
    for directory, subdirs, names in os.walk(folder, followlinks=True):
        kept = []
        for d in sorted(subdirs):  # sorted: of two names for one folder, the first is walked
            if d.startswith("."):
                continue
            real = os.path.realpath(os.path.join(directory, d))
            if real in seen:
                skipped.append((os.path.join(directory, d), "a link to a folder above it or "
                                "already scanned (not followed)"))
            else:
                seen.add(real)
                kept.append(d)
        subdirs[:] = kept
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith("."):
                continue
            if name.lower().endswith(IMAGE_EXTENSIONS):
                candidates.append(path)
            else:
                skipped.append((path, "not an image file (suffix)"))
    with concurrent.futures.ThreadPoolExecutor(default_workers()) as pool:
        examined = list(pool.map(_examined, candidates, chunksize=64))
    found = [(p, identity) for p, (problem, identity) in zip(candidates, examined) if problem is None]
    skipped += [(p, problem) for p, (problem, _) in zip(candidates, examined) if problem is not None]
    return sorted(found), sorted(skipped)  # paths under one folder: sorted as their names


def _examined(path: str) -> tuple[str | None, tuple[int, int] | None]:
    """(header_problem(path), and where it is None the file's (device, inode)), on the scan's
    threads: a stat is a round trip on a network file system (gcsfuse), so it goes beside the
    header's open and read, not in a loop of its own after them."""
    problem = header_problem(path)
    if problem is not None:
        return problem, None
    stat = os.stat(path)
    return None, (stat.st_dev, stat.st_ino)


def _check_one_class_each(files: list[str], labels: list[int], identities: list[tuple[int, int]],
                          classes: tuple[str, ...]) -> None:
    """A MeshfitError where one file (the same device and inode: links and hard links followed) is
    listed under two classes. The walk of each class cannot see it: a class folder that is a link
    to the dataset's folder lists every other class's images under its own name."""
    first = {}
    for path, label, identity in zip(files, labels, identities):
        seen_path, seen_label = first.setdefault(identity, (path, label))
        if seen_label != label:
            raise MeshfitError(
                f"{path} (class {classes[label]}) is the same file as {seen_path} (class "
                f"{classes[seen_label]}), reached through a link: an image has one class; remove "
                "the link (or the class folder that is one) that puts it under both")


def _real_ancestors(folder: str) -> list[str]:
    """The real paths of `folder` and of every folder above it, up to the file system's root."""
    path, found = os.path.realpath(folder), []
    while True:
        found.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            return found
        path = parent


def layout(path: str | os.PathLike, validation_split: float, seed: int) -> dict[str, Folder | None]:
    """{"train", "validation", "test"}: the folders to train, validate and test on.

    A folder with a train/ sub-folder, and test/ and/or val/ (or validation/) ones, is used as
    given; without val/, validation_split then splits train/. Otherwise the folder itself is
    split: in each class round(n * validation_split) files (half up, at least one left in train),
    chosen with `seed`, go to validation, and "test" is None. validation_split 0: no validation.
    A test/ or val/ folder without train/ is refused: it had become a class of its own.
    """
    if not 0.0 <= validation_split < 1.0:
        raise MeshfitError(f"validation_split must be in [0, 1), got {validation_split}")
    root = os.path.abspath(os.fspath(path))
    splits = {key: next((os.path.join(root, n) for n in names if os.path.isdir(os.path.join(root, n))), None)
              for key, names in SPLIT_NAMES.items()}
    if not splits["train"] and (splits["validation"] or splits["test"]):
        found = splits["validation"] or splits["test"]
        raise MeshfitError(f"{root} has {os.path.basename(found)}/ but no train/ folder, so "
                           f"{os.path.basename(found)} would be a class; put the training images in "
                           f"{os.path.join(root, 'train')}/<class name>/ (or rename that folder if "
                           "it is a class)")
    if splits["train"]:
        train = scan(splits["train"])
        test = scan(splits["test"], train.class_names) if splits["test"] else None
        if splits["validation"]:
            return {"train": train, "validation": scan(splits["validation"], train.class_names),
                    "test": test}
        train, validation = split(train, validation_split, seed)
        return {"train": train, "validation": validation, "test": test}
    train, validation = split(scan(root), validation_split, seed)
    return {"train": train, "validation": validation, "test": None}


def split(folder: Folder, fraction: float, seed: int) -> tuple[Folder, Folder | None]:
    """(train, validation): per class, round(n * fraction) files chosen with `seed` to validation."""
    if fraction <= 0:
        return folder, None
    rng = np.random.default_rng(seed)
    held = []
    for label in range(len(folder.class_names)):
        members = np.flatnonzero(folder.labels == label)
        count = min(int(len(members) * fraction + 0.5), len(members) - 1)
        held += list(members[rng.permutation(len(members))[:count]])
    held = np.sort(np.asarray(held, dtype=np.int64))
    kept = np.setdiff1d(np.arange(len(folder)), held)
    return folder.subset(kept), (folder.subset(held) if len(held) else None)
