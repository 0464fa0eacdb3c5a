"""DATE (Chen et al. 2024): a fully convolutional detector with dual assignment.

One backbone, a 3-level FPN and one pair of shared GroupNorm conv towers (cls, reg) feed two
predictors: the one-to-one predictor trained with POTO (``jaxsys.vision.assign.poto_match``)
and, when ``dual=True``, a one-to-many FCOS predictor (own cls/reg convs plus centerness).
Both losses are summed in training; inference uses the one-to-one predictor only, with no NMS
(score > ``score_threshold``, then the top ``max_detections``), so the one-to-many branch costs
nothing at test time: a ``dual=False`` model has the same inference graph.

Regression (both predictors) is ``ReLU(scale_level * x) * stride`` as (l, t, r, b) distances from
each location (FCOS eq. 1), with one learnable ``Scale`` per level shared by the predictors.

Usage::

  cfg = DATEConfig(num_classes=5, dual=True)
  model = DATE(cfg, rngs=nnx.Rngs(0))
  loss, metrics = date_loss(model, images, gt_boxes, gt_labels, gt_valid)
  step = make_date_train_step(model, OptimizerConfig("adamw", 1e-3).build())   # one jit, Hungarian included
  det = model.detect(images)                                   # NMS-free, one-to-one branch
  det = model.detect(images, branch="o2m", nms_iou=0.6)        # FCOS branch with NMS

On CPU, call ``jaxsys.core.xla_cpu.apply()`` before any JAX work: XLA:CPU's YNNPACK convolutions
run this model's backward pass slowly (a train step's gradient 150 ms -> 107 ms without them, on
2 cores); the experiments do.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsys.core.errors import ConfigError, ShapeError, check_min, check_one_of, check_positive, check_range
from jaxsys.vision import assign as A
from jaxsys.vision.boxes import nms
from jaxsys.vision.losses import one_to_many_loss, one_to_one_loss
from jaxsys.core import init

__all__ = [
    "ConvGNReLU", "DATE", "date_loss", "DATEConfig", "DATEHead", "decode_ltrb", "DetectionBackbone",
    "DetectionFPN", "make_date_train_step", "make_detect_fn", "predict_dataset", "select_detections",
    "STRIDES", "train_detector",
]

STRIDES = (4, 8, 16)  # FPN levels P2-P4 of the small backbone (the paper: P3-P7 of ResNet-50)


@dataclasses.dataclass(frozen=True)
class DATEConfig:
  num_classes: int = 5
  image_size: int = 64
  widths: tuple[int, ...] = (16, 32, 64, 96)  # stem (stride 2), then strides 4, 8, 16
  fpn_channels: int = 48
  head_convs: int = 4  # convs per shared tower, as in the paper
  gn_groups: int = 8
  dual: bool = True  # build and train the one-to-many (FCOS) branch
  alpha: float = 0.8  # POTO quality exponent
  radius: float = 1.5  # POTO's centre prior radius in strides
  # One-to-many (FCOS) positives: every point inside the box (False, DATE's configs, mmdet's
  # ``center_sampling=False``) or only its centre region of ``radius`` strides (True).
  o2m_center_sampling: bool = False
  regress_ranges: tuple[tuple[float, float], ...] = ((-1.0, 8.0), (8.0, 16.0), (16.0, 1e8))
  prior_prob: float = 0.01
  score_threshold: float = 0.01
  max_detections: int = 100
  pre_nms: int = 300

  def __post_init__(self):
    check_positive(self, "num_classes", "image_size", "fpn_channels", "gn_groups",
                   "max_detections", "pre_nms", integer=True)
    check_min(self, 1, "head_convs")
    if len(self.widths) != len(STRIDES) + 1 or min(self.widths) < 1:
      raise ConfigError(f"widths={self.widths} must be {len(STRIDES) + 1} positive channel counts")
    if self.image_size % STRIDES[-1]:
      raise ConfigError(f"image_size={self.image_size} must be divisible by {STRIDES[-1]}")
    for name in ("fpn_channels",):
      if getattr(self, name) % self.gn_groups:
        raise ConfigError(f"{name}={getattr(self, name)} must be divisible by gn_groups={self.gn_groups}")
    if len(self.regress_ranges) != len(STRIDES):
      raise ConfigError(f"regress_ranges={self.regress_ranges} must give one (lo, hi) per level {STRIDES}")
    check_range("alpha", self.alpha, 0, 1)
    check_range("prior_prob", self.prior_prob, 0, 1, lo_open=True, hi_open=True)
    check_range("score_threshold", self.score_threshold, 0, 1)
    check_positive(self, "radius")

  @property
  def num_points(self) -> int:
    return sum((self.image_size // s) ** 2 for s in STRIDES)


def _conv(cin, cout, rngs, *, k=3, stride=1, std=None, bias=0.0):
  inits = init.dense_defaults() if std is None else {"kernel_init": init.normal(std)}
  return nnx.Conv(cin, cout, (k, k), strides=stride, padding="SAME", rngs=rngs,
                  **{**inits, "bias_init": init.constant(bias)})


class ConvGNReLU(nnx.Module):
  def __init__(self, cin, cout, groups, rngs, *, stride=1, std=None):
    self.conv = _conv(cin, cout, rngs, stride=stride, std=std)
    self.norm = nnx.GroupNorm(cout, num_groups=math.gcd(groups, cout), rngs=rngs, **init.norm_defaults())

  def __call__(self, x):
    return jax.nn.relu(self.norm(self.conv(x)))


class DetectionBackbone(nnx.Module):
  """A small residual CNN: stem (stride 2) then stages at strides 4, 8, 16 -> [C2, C3, C4]."""

  def __init__(self, cfg: DATEConfig, rngs: nnx.Rngs):
    w, g = cfg.widths, cfg.gn_groups
    self.stem = ConvGNReLU(3, w[0], g, rngs, stride=2)
    self.down = nnx.List([ConvGNReLU(w[i], w[i + 1], g, rngs, stride=2) for i in range(3)])
    self.res = nnx.List([ConvGNReLU(w[i + 1], w[i + 1], g, rngs) for i in range(3)])

  def __call__(self, x):
    x = self.stem(x)
    feats = []
    for down, res in zip(self.down, self.res):
      x = down(x)
      x = x + res(x)
      feats.append(x)
    return feats


class DetectionFPN(nnx.Module):
  """Feature pyramid (Lin et al. 2017): 1x1 laterals, nearest top-down upsampling, 3x3 outputs."""

  def __init__(self, cfg: DATEConfig, rngs: nnx.Rngs):
    c = cfg.fpn_channels
    self.lateral = nnx.List([_conv(w, c, rngs, k=1) for w in cfg.widths[1:]])
    self.out = nnx.List([_conv(c, c, rngs) for _ in cfg.widths[1:]])

  def __call__(self, feats):
    lat = [m(f) for m, f in zip(self.lateral, feats)]
    for i in range(len(lat) - 2, -1, -1):
      up = jnp.repeat(jnp.repeat(lat[i + 1], 2, axis=1), 2, axis=2)
      lat[i] = lat[i] + up
    return [m(x) for m, x in zip(self.out, lat)]


class _Predictor(nnx.Module):
  def __init__(self, cfg: DATEConfig, rngs: nnx.Rngs, centerness: bool):
    c = cfg.fpn_channels
    bias = -math.log((1 - cfg.prior_prob) / cfg.prior_prob)  # RetinaNet prior init
    self.cls = _conv(c, cfg.num_classes, rngs, std=0.01, bias=bias)
    self.reg = _conv(c, 4, rngs, std=0.01)
    self.ctr = _conv(c, 1, rngs, std=0.01) if centerness else None


class DATEHead(nnx.Module):
  """Shared cls/reg towers over all levels, a ``Scale`` per level, and the two predictors."""

  def __init__(self, cfg: DATEConfig, rngs: nnx.Rngs):
    c, g = cfg.fpn_channels, cfg.gn_groups
    self.cls_tower = nnx.List([ConvGNReLU(c, c, g, rngs, std=0.01) for _ in range(cfg.head_convs)])
    self.reg_tower = nnx.List([ConvGNReLU(c, c, g, rngs, std=0.01) for _ in range(cfg.head_convs)])
    self.scales = nnx.Param(jnp.ones((len(STRIDES),), jnp.float32))
    self.o2o = _Predictor(cfg, rngs, centerness=False)
    self.o2m = _Predictor(cfg, rngs, centerness=True) if cfg.dual else None

  def __call__(self, feats, *, with_o2m: bool):
    out = {"o2o_cls": [], "o2o_reg": [], "o2m_cls": [], "o2m_reg": [], "o2m_ctr": []}
    for lvl, (x, stride) in enumerate(zip(feats, STRIDES)):
      cf, rf = x, x
      for m in self.cls_tower:
        cf = m(cf)
      for m in self.reg_tower:
        rf = m(rf)
      preds = [("o2o", self.o2o)] + ([("o2m", self.o2m)] if with_o2m else [])
      for name, p in preds:
        b, h, w, _ = cf.shape
        out[f"{name}_cls"].append(p.cls(cf).reshape(b, h * w, -1))  # [B, H*W, C]
        reg = jax.nn.relu(self.scales[lvl] * p.reg(rf)) * stride  # (l, t, r, b) pixels
        out[f"{name}_reg"].append(reg.reshape(b, h * w, 4))
        if p.ctr is not None:
          out[f"{name}_ctr"].append(p.ctr(rf).reshape(b, h * w))
    return {k: jnp.concatenate(v, 1) for k, v in out.items() if v}


def decode_ltrb(points, d):
  """(l, t, r, b) distances ``[B, N, 4]`` at ``points [N, 2]`` -> xyxy boxes."""
  return jnp.concatenate([points - d[..., :2], points + d[..., 2:]], -1)


class DATE(nnx.Module):
  """Backbone + FPN + DATE head. ``model(images)`` returns per-location outputs over the
  concatenated levels (``N = cfg.num_points``): ``o2o_cls [B, N, C]``, ``o2o_box [B, N, 4]``
  (xyxy pixels), and with the one-to-many branch ``o2m_cls``, ``o2m_box``, ``o2m_ctr [B, N]``."""

  def __init__(self, cfg: DATEConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.backbone = DetectionBackbone(cfg, rngs)
    self.fpn = DetectionFPN(cfg, rngs)
    self.head = DATEHead(cfg, rngs)

  def check_images(self, images):
    s = self.cfg.image_size
    if images.ndim != 4 or images.shape[1:] != (s, s, 3):
      raise ShapeError(f"images must be float[batch, {s}, {s}, 3], got shape {tuple(images.shape)}")

  def __call__(self, images, *, with_o2m: bool | None = None):
    self.check_images(images)
    with_o2m = self.cfg.dual if with_o2m is None else with_o2m
    if with_o2m and not self.cfg.dual:
      raise ConfigError("with_o2m=True needs a model built with dual=True")
    out = self.head(self.fpn(self.backbone(images.astype(jnp.float32))), with_o2m=with_o2m)
    points, _ = A.anchor_points(self.cfg.image_size, STRIDES)
    res = {"o2o_cls": out["o2o_cls"], "o2o_box": decode_ltrb(points, out["o2o_reg"])}
    if with_o2m:
      res.update(o2m_cls=out["o2m_cls"], o2m_box=decode_ltrb(points, out["o2m_reg"]),
                 o2m_ctr=out["o2m_ctr"])
    return res

  def detect(self, images, *, branch: str = "o2o", nms_iou: float | None = None):
    """Detections ``{boxes [B, K, 4], scores [B, K], labels [B, K], valid [B, K]}``,
    ``K = cfg.max_detections``, best first. ``branch="o2o"`` (default, end-to-end): no NMS
    unless ``nms_iou`` is given; ``"o2m"``: FCOS scores (cls x centerness)."""
    check_one_of("branch", branch, ("o2o", "o2m"))
    out = self(images, with_o2m=branch == "o2m")
    scores = jax.nn.sigmoid(out[f"{branch}_cls"])  # [B, N, C]
    if branch == "o2m":
      scores = scores * jax.nn.sigmoid(out["o2m_ctr"])[..., None]
    return select_detections(scores, out[f"{branch}_box"], self.cfg, nms_iou=nms_iou)


def select_detections(scores, boxes, cfg: DATEConfig, *, nms_iou: float | None = None):
  """Top-k over (location, class) pairs with score > threshold, optionally after class-aware
  NMS on the top ``cfg.pre_nms`` candidates. ``scores [B, N, C]``, ``boxes [B, N, 4]``."""
  b, n, c = scores.shape
  k = min(cfg.max_detections, n * c)
  flat = scores.reshape(b, n * c)
  if nms_iou is not None:
    pre = min(cfg.pre_nms, n * c)
    s, idx = jax.lax.top_k(flat, pre)
    bx = jnp.take_along_axis(boxes, (idx // c)[..., None], 1)
    lab = idx % c
    keep = jax.vmap(lambda bb, ss, ll: nms(bb, ss, nms_iou, labels=ll,
                                           valid=ss > cfg.score_threshold))(bx, s, lab)
    s2, j = jax.lax.top_k(jnp.where(keep, s, -1.0), k)
    idx = jnp.take_along_axis(idx, j, 1)
    s = jnp.take_along_axis(s, j, 1)
    valid = s2 > cfg.score_threshold
  else:
    s, idx = jax.lax.top_k(flat, k)
    valid = s > cfg.score_threshold
  bx = jnp.take_along_axis(boxes, (idx // c)[..., None], 1)
  return {"boxes": bx, "scores": jnp.where(valid, s, 0.0), "labels": idx % c, "valid": valid}


def date_loss(model: DATE, images, gt_boxes, gt_labels, gt_valid):
  """Training loss (sum of both branches) and its parts. Ground truths are padded ``[B, G]``
  with a ``valid`` mask; an image without objects contributes only background terms."""
  cfg = model.cfg
  out = model(images)
  points, strides = A.anchor_points(cfg.image_size, STRIDES)
  gt_boxes = gt_boxes.astype(jnp.float32)
  match = A.poto_match(out["o2o_cls"], out["o2o_box"], points, strides, gt_boxes, gt_labels,
                       gt_valid, alpha=cfg.alpha, radius=cfg.radius)
  t1 = A.one_to_one_targets(match, gt_boxes, gt_labels, num_points=cfg.num_points,
                            num_classes=cfg.num_classes)
  parts = one_to_one_loss(out["o2o_cls"], out["o2o_box"], t1, num_classes=cfg.num_classes,
                          image_size=cfg.image_size)
  if cfg.dual:
    ranges = A.regress_ranges_for(strides, STRIDES, cfg.regress_ranges)
    tm = A.fcos_targets(points, strides, ranges, gt_boxes, gt_labels, gt_valid,
                        num_classes=cfg.num_classes,
                        radius=cfg.radius if cfg.o2m_center_sampling else None)
    parts.update(one_to_many_loss(out["o2m_cls"], out["o2m_box"], out["o2m_ctr"], tm,
                                  num_classes=cfg.num_classes))
  loss = sum(parts.values())
  return loss, parts


def make_date_train_step(model: DATE, tx, *, jit: bool = True):
  """``train.make_train_step`` on :func:`date_loss` for this model:
  ``step(params, opt_state, rest, images, gt_boxes, gt_labels, gt_valid)``
  ``-> (params, opt_state, loss, parts, rest)``; returns ``(step, graphdef, params, rest)``."""
  from jaxsys.train import make_train_step
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  step = make_train_step(date_loss, tx, graphdef=graphdef, has_aux=True, jit=jit)
  return step, graphdef, params, rest


def make_detect_fn(graphdef, *, branch: str = "o2o", nms_iou: float | None = None):
  """Jitted ``fn(params, rest, images) -> detections`` of :meth:`DATE.detect` for a split model."""
  return jax.jit(lambda params, rest, images: nnx.merge(graphdef, params, rest).detect(
      images, branch=branch, nms_iou=nms_iou))


def predict_dataset(detect_fn, params, rest, images, *, batch_size: int = 64):
  """Runs ``detect_fn`` over ``images`` in batches (the last one padded) -> per-image
  ``(boxes, scores, labels)`` numpy tuples for ``jaxsys.eval.detection``."""
  from jaxsys.vision.boxes import from_batch
  out = []
  for i in range(0, len(images), batch_size):
    x = images[i:i + batch_size]
    n = len(x)
    if n < batch_size:  # one compiled shape
      x = np.concatenate([x, np.zeros((batch_size - n, *x.shape[1:]), x.dtype)])
    d = jax.device_get(detect_fn(params, rest, x))
    out += from_batch(d["boxes"][:n], d["scores"][:n], d["labels"][:n], d["valid"][:n])
  return out


def train_detector(model: DATE, data, *, steps: int, batch_size: int, learning_rate: float = 2e-3,
                   warmup_steps: int = 100, seed: int = 0, mesh=None, eval_every: int | None = None,
                   on_eval=None, optimizer: str = "adamw", weight_decay: float = 1e-4):
  """Trains ``model`` on ``data`` (a ``jaxsys.data.shapes.Shapes``) with the library's optimizer
  (``train.make_optimizer``: warm-up + cosine, clipping; ``optimizer="adamw"`` by default, or
  ``"sgd"`` with momentum 0.9, the detectors' recipe, e.g. ``learning_rate=0.01`` at batch 16)
  and :func:`make_date_train_step`.

  Batches are drawn without replacement per epoch from a ``seed``-ed permutation. With ``mesh``
  the batch is split over its "data" axis and parameters are replicated (data parallelism; the
  loss is over the global batch, so it equals the single-device step). Every ``eval_every`` steps
  (and after the last), ``on_eval(step, params, rest)`` is called. Returns
  ``(params, rest, graphdef, history)``, history = one ``{"step", "loss", parts...}`` per step.
  """
  from jaxsys.train import TrainConfig, make_optimizer, run_steps
  if batch_size > len(data):
    raise ConfigError(f"batch_size={batch_size} must be <= the data set size {len(data)}")
  tx = make_optimizer(TrainConfig(learning_rate=learning_rate, warmup_steps=warmup_steps,
                                  total_steps=steps, weight_decay=weight_decay, b2=0.999, grad_clip=10.0,
                                  optimizer=optimizer))
  step, graphdef, params, rest = make_date_train_step(model, tx)
  opt_state = tx.init(params)
  put = (lambda x: x)
  if mesh is not None:
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxsys.core.mesh import auto_mesh
    mesh = auto_mesh(mesh)  # Explicit axes (jax.make_mesh's default) run on the Auto twin, as in train
    if "data" not in mesh.axis_names:
      raise ConfigError(f"mesh axes {mesh.axis_names} must include 'data' (the batch is split over it)")
    if batch_size % mesh.shape["data"]:
      raise ConfigError(f"batch_size={batch_size} must be divisible by the mesh's "
                        f"data axis ({mesh.shape['data']})")
    rep, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params, opt_state, rest = jax.device_put((params, opt_state, rest), rep)
    put = (lambda x: jax.device_put(x, split))
  rng = np.random.default_rng(seed)
  epoch = {"order": rng.permutation(len(data)), "pos": 0}

  def batch(s, params, rest):  # without replacement within an epoch, a new permutation after it
    if epoch["pos"] + batch_size > len(epoch["order"]):
      epoch.update(order=rng.permutation(len(data)), pos=0)
    idx = np.sort(epoch["order"][epoch["pos"]:epoch["pos"] + batch_size])
    epoch["pos"] += batch_size
    return tuple(put(x[idx]) for x in (data.images, data.boxes, data.labels, data.valid))

  # sync: one step in flight at a time, as a long queue of steps that each wait on a host
  # callback (the Hungarian matching) can stall the CPU runtime's thread pool
  def evaluate(s, params, rest):  # never stops the run
    on_eval(s, params, rest)

  evals = on_eval is not None and bool(eval_every)
  run = run_steps(step, params, opt_state, rest, batch, steps=steps, sync=True,
                  every=eval_every if evals else 0, on_every=evaluate if evals else None)
  params, rest, history = run.params, run.rest, run.history
  return params, rest, graphdef, history
