"""Pure data: models, hardware, layouts and their catalogues. Never imports torch."""

from modelcarve.spec.errors import LayoutError, ModelcarveError, SpecError
from modelcarve.spec.model import ModelSpec
from modelcarve.spec.hardware import ClusterSpec, DeviceSpec, LinkSpec
from modelcarve.spec.layout import Layout

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "Layout",
    "LayoutError",
    "LinkSpec",
    "ModelSpec",
    "ModelcarveError",
    "SpecError",
]
