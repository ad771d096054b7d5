"""The registered models: the torchvision models the papers use, plus the KAPAO- and
AGRNav-architecture models. Built with ``weights=None`` so nothing is downloaded."""

import torchvision.models as tvm
import torchvision.models.detection as tvd
import torchvision.models.segmentation as tvs
import torch
from torch import nn

from robot_offload.models.registry import ModelSpec, register


def _classifier(name, ctor, description):
    register(ModelSpec(name=name, task="classification", input_kind="image",
                       input_size=(224, 224), test_input_size=(64, 64),
                       constructor=lambda: ctor(weights=None), description=description))


_classifier("resnet18", tvm.resnet18, "ResNet-18 (the demo's default: cheap on a CPU)")
_classifier("resnet50", tvm.resnet50, "ResNet-50")
_classifier("resnet101", tvm.resnet101, "ResNet-101 (RRTO, Intra-DP)")
_classifier("vgg19", tvm.vgg19, "VGG-19 (Hybrid-Parallel Tab. 6-7)")
_classifier("convnext_tiny", tvm.convnext_tiny, "ConvNeXt-T (RRTO, Hybrid-Parallel)")
_classifier("densenet121", tvm.densenet121, "DenseNet-121 (Hybrid-Parallel)")
_classifier("regnet_y_400mf", tvm.regnet_y_400mf, "RegNetY-400MF (Hybrid-Parallel)")
_classifier("mobilenet_v2", tvm.mobilenet_v2, "MobileNetV2 (Intra-DP)")
_classifier("mobilenet_v3_large", tvm.mobilenet_v3_large, "MobileNetV3-Large")


class SegmentationAdapter(nn.Module):
    """Returns the ``out`` map only (torchvision returns an OrderedDict with aux heads)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def _segmenter(name, ctor, description):
    register(ModelSpec(name=name, task="segmentation", input_kind="image",
                       input_size=(520, 520), test_input_size=(64, 64),
                       constructor=lambda: SegmentationAdapter(
                           ctor(weights=None, weights_backbone=None, aux_loss=False)),
                       description=description))


_segmenter("fcn_resnet50", tvs.fcn_resnet50, "FCN-ResNet50 (RRTO Tab. V)")
_segmenter("deeplabv3_resnet50", tvs.deeplabv3_resnet50, "DeepLabV3-ResNet50 (RRTO Tab. V)")


class DetectionAdapter(nn.Module):
    """Batched tensor in (N x 3 x H x W, 0..1), torchvision's list of dicts out.

    The registry's preprocessing already resized the frame, so the detector's own resize is
    switched off (it would otherwise upscale every frame to 800 px)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        model.transform.resize = self._keep_size

    @staticmethod
    def _keep_size(image, target=None):
        return image, target

    def forward(self, x):
        return self.model(list(x))


def _detector(name, ctor, description):
    register(ModelSpec(name=name, task="detection", input_kind="image",
                       input_size=(512, 512), test_input_size=(128, 128),
                       constructor=lambda: DetectionAdapter(ctor(weights=None, weights_backbone=None)),
                       mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), description=description))


_detector("fasterrcnn_resnet50_fpn", tvd.fasterrcnn_resnet50_fpn, "Faster R-CNN R50-FPN (RRTO Tab. V)")
_detector("retinanet_resnet50_fpn", tvd.retinanet_resnet50_fpn, "RetinaNet R50-FPN (RRTO Tab. V)")


class KeypointAdapter(nn.Module):
    """KAPAO returns (decoded predictions, raw head maps); only the first is used after
    inference, and the raw maps are as large again (23 MB at 1280 px): leave them behind."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def _kapao():
    from robot_offload.models.kapao import build_kapao
    return KeypointAdapter(build_kapao())


class OccupancyAdapter(nn.Module):
    """What a planner needs from AGRNav, compactly: per voxel an occupancy logit (the best
    occupied class's score minus the empty class's: above 0 exactly where the label is not
    empty) and the semantic label (uint8 argmax), both ``N x 1 x X x Z x Y``, instead of 20
    scores per voxel (168 MB per 256 x 256 x 32 frame, 16x the two together) crossing the
    link."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        scores = self.model(x)
        occupancy = scores[:, 1:].amax(1, keepdim=True) - scores[:, :1]
        return {"occupancy": occupancy, "labels": scores.argmax(1, keepdim=True).to(torch.uint8)}


def _agrnav():
    from robot_offload.models.agrnav import build_agrnav
    return OccupancyAdapter(build_agrnav())


register(ModelSpec(name="kapao_l", task="keypoints", input_kind="image",
                   input_size=(1280, 1280), test_input_size=(128, 128), constructor=_kapao,
                   mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0),
                   description="KAPAO-L architecture: YOLOv5l6-style keypoint-object detector"))
register(ModelSpec(name="agrnav", task="occupancy", input_kind="pointcloud",
                   input_size=(256, 256, 32), test_input_size=(32, 16, 32), constructor=_agrnav,
                   description="AGRNav's SCONet architecture: voxel grid in, occupancy + semantic labels"))
