"""COCO-style detection AP (AP@[.5:.95], AP50, AP75), a pycocotools cross-check, duplicate rate.

:func:`coco_ap` reimplements ``pycocotools.cocoeval.COCOeval`` for boxes (area range "all",
``max_dets`` per image, no crowd): per image and class, detections sorted by score (stable) and
cut to ``max_dets`` are greedily matched to the unmatched ground truth of highest IoU >= t, for
t in 0.50:0.05:0.95; per class, precision is made monotone and sampled at 101 recall points;
AP is the mean over thresholds, recall points and classes that have ground truths.
:func:`pycocotools_ap` runs pycocotools itself on the same inputs (``pip install pycocotools``;
a dev extra), and the tests check both agree to 1e-3.

Inputs are per-image lists: ``preds[i] = (boxes [n, 4] xyxy, scores [n], labels [n])`` and
``gts[i] = (boxes [m, 4], labels [m])``; :func:`from_batch` converts padded batch arrays.

Usage::

  ap = coco_ap(preds, gts, num_classes=5)   # {"AP": .., "AP50": .., "AP75": ..}
  dup = duplicate_rate(preds, gts)          # detections of an already-found object / detections
"""

from __future__ import annotations

import contextlib
import io

import numpy as np

from jaxsys.core.errors import InputError
from jaxsys.vision.boxes import check_boxes, from_batch  # noqa: F401  (from_batch: re-exported)

__all__ = ["coco_ap", "duplicate_rate", "from_batch", "IOU_THRESHOLDS", "pycocotools_ap", "RECALL_POINTS"]

IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)
RECALL_POINTS = np.linspace(0.0, 1.0, 101)


def _np_iou(a, b):
  """Pairwise IoU ``[n, m]`` of xyxy boxes (numpy, as pycocotools computes it from xywh)."""
  if len(a) == 0 or len(b) == 0:
    return np.zeros((len(a), len(b)))
  lt = np.maximum(a[:, None, :2], b[None, :, :2])
  rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
  inter = np.prod(np.clip(rb - lt, 0, None), -1)
  area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
  union = area(a)[:, None] + area(b)[None] - inter
  return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def _check(preds, gts):
  if len(preds) != len(gts):
    raise InputError(f"preds has {len(preds)} images but gts has {len(gts)}")
  for i, (p, g) in enumerate(zip(preds, gts)):
    if len(p) != 3 or len(g) != 2:
      raise InputError(f"image {i}: preds must be (boxes, scores, labels) and gts (boxes, labels)")
    check_boxes(f"preds[{i}] boxes", np.asarray(p[0], np.float64).reshape(-1, 4))
    check_boxes(f"gts[{i}] boxes", np.asarray(g[0], np.float64).reshape(-1, 4))


def _match_image(db, ds, gb, thresholds):
  """Greedy COCO matching of one image/class: ``tp bool[T, n]`` for score-sorted detections."""
  ious = _np_iou(db, gb)
  tp = np.zeros((len(thresholds), len(db)), bool)
  for ti, t in enumerate(thresholds):
    taken = np.zeros(len(gb), bool)
    for d in range(len(db)):
      best, m = min(t, 1 - 1e-10), -1
      for g in range(len(gb)):
        if taken[g] or ious[d, g] < best:
          continue
        best, m = ious[d, g], g
      if m >= 0:
        taken[m], tp[ti, d] = True, True
  return tp


def coco_ap(preds, gts, *, num_classes: int, max_dets: int = 100) -> dict[str, float]:
  """COCO box AP, AP50, AP75 (fractions in [0, 1]); -1 where no class has a ground truth."""
  _check(preds, gts)
  t_n = len(IOU_THRESHOLDS)
  precision = -np.ones((t_n, len(RECALL_POINTS), num_classes))
  for c in range(num_classes):
    scores, tps, npos = [], [], 0
    for (pb, ps, pl), (gb, gl) in zip(preds, gts):
      pb, ps, pl = np.asarray(pb, np.float64).reshape(-1, 4), np.asarray(ps), np.asarray(pl)
      gb, gl = np.asarray(gb, np.float64).reshape(-1, 4), np.asarray(gl)
      g = gb[gl == c]
      npos += len(g)
      sel = pl == c
      order = np.argsort(-ps[sel], kind="mergesort")[:max_dets]
      db, ds = pb[sel][order], ps[sel][order]
      scores.append(ds)
      tps.append(_match_image(db, ds, g, IOU_THRESHOLDS))
    if npos == 0:
      continue
    s = np.concatenate(scores)
    order = np.argsort(-s, kind="mergesort")
    tp = np.concatenate(tps, 1)[:, order]
    tp_sum = np.cumsum(tp, 1).astype(float)
    fp_sum = np.cumsum(~tp, 1).astype(float)
    for ti in range(t_n):
      rc = tp_sum[ti] / npos
      pr = tp_sum[ti] / (fp_sum[ti] + tp_sum[ti] + np.spacing(1))
      pr = np.maximum.accumulate(pr[::-1])[::-1] if len(pr) else pr  # monotone envelope
      q = np.zeros(len(RECALL_POINTS))
      inds = np.searchsorted(rc, RECALL_POINTS, side="left")
      ok = inds < len(pr)
      q[ok] = pr[inds[ok]]
      precision[ti, :, c] = q

  def mean(p):
    p = p[p > -1]
    return float(p.mean()) if p.size else -1.0

  return {"AP": mean(precision), "AP50": mean(precision[0]), "AP75": mean(precision[5])}


def pycocotools_ap(preds, gts, *, num_classes: int, max_dets: int = 100) -> dict[str, float]:
  """The same AP computed by pycocotools (needs ``pycocotools``, a dev extra)."""
  try:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
  except ImportError as e:  # pragma: no cover
    raise ImportError("pycocotools_ap needs pycocotools: pip install 'jaxsys[dev]'") from e
  _check(preds, gts)
  images, anns, dets = [], [], []
  for i, ((pb, ps, pl), (gb, gl)) in enumerate(zip(preds, gts)):
    images.append({"id": i + 1, "width": 1, "height": 1})
    for b, lab in zip(np.asarray(gb).reshape(-1, 4), np.asarray(gl)):
      w, h = float(b[2] - b[0]), float(b[3] - b[1])
      anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": int(lab) + 1,
                   "bbox": [float(b[0]), float(b[1]), w, h], "area": w * h, "iscrowd": 0})
    for b, s, lab in zip(np.asarray(pb).reshape(-1, 4), np.asarray(ps), np.asarray(pl)):
      dets.append({"image_id": i + 1, "category_id": int(lab) + 1, "score": float(s),
                   "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]})
  with contextlib.redirect_stdout(io.StringIO()):
    gt = COCO()
    gt.dataset = {"images": images, "annotations": anns,
                  "categories": [{"id": c + 1} for c in range(num_classes)]}
    gt.createIndex()
    if not dets:
      return {"AP": 0.0, "AP50": 0.0, "AP75": 0.0}
    dt = gt.loadRes(dets)
    ev = COCOeval(gt, dt, "bbox")
    ev.params.maxDets = [max_dets]  # evaluate() sorts this list and uses its last entry
    ev.params.areaRng = [[0, 1e10]] * 4
    ev.evaluate()
    ev.accumulate()
  # precision [T, R, K, area, max_dets]: area "all", our one max_dets
  prec = ev.eval["precision"][:, :, :, 0, -1]

  def mean(p):
    p = p[p > -1]
    return float(p.mean()) if p.size else -1.0

  return {"AP": mean(prec), "AP50": mean(prec[0]), "AP75": mean(prec[5])}


def duplicate_rate(preds, gts, *, score_threshold: float = 0.3, iou_threshold: float = 0.5) -> float:
  """Fraction of confident detections (score >= threshold) that re-detect an object: their best
  same-class ground truth (IoU >= ``iou_threshold``) was already claimed by a higher-scored one."""
  _check(preds, gts)
  dup = total = 0
  for (pb, ps, pl), (gb, gl) in zip(preds, gts):
    pb, ps, pl = np.asarray(pb).reshape(-1, 4), np.asarray(ps), np.asarray(pl)
    gb, gl = np.asarray(gb).reshape(-1, 4), np.asarray(gl)
    keep = ps >= score_threshold
    pb, ps, pl = pb[keep], ps[keep], pl[keep]
    total += len(ps)
    ious = _np_iou(pb, gb) * (pl[:, None] == gl[None, :])
    claimed = np.zeros(len(gb), bool)
    for d in np.argsort(-ps, kind="mergesort"):
      if len(gb) == 0:
        break
      g = int(np.argmax(ious[d]))
      if ious[d, g] < iou_threshold:
        continue
      dup += claimed[g]
      claimed[g] = True
  return dup / total if total else 0.0
