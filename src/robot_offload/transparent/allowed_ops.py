"""The operators the offload server runs for a client: dense computation only.

Derived with ``python -m robot_offload.transparent.allowlist --derive`` (the overloads that
reach a TorchDispatchMode while the registry models, the test programs and common
user-side tensor code run) and reviewed by hand; see
:mod:`robot_offload.transparent.allowlist` for what is kept off and why. The comment after
each name says where the derivation met it (registry, programs, habits).
"""

ALLOWED_OPS = frozenset({
    # Convolution and matrix products: the bulk of every model (conv, linear, attention
    # projections). _unsafe_view is matmul's own reshape of its result (a view with view's size
    # checks, outside autograd's alias tracking); resolve_conj/resolve_neg are no-ops on the real
    # tensors allowed here. im2col/col2im are unfold/fold.
    'aten::_cdist_forward.default',  # habits
    'aten::_unsafe_view.default',  # registry, habits
    'aten::addmm.default',  # registry, programs, habits
    'aten::baddbmm.default',  # habits
    'aten::bmm.default',  # registry, habits
    'aten::cdist.default',  # habits
    'aten::col2im.default',  # habits
    'aten::conv1d.default',  # habits
    'aten::conv2d.default',  # registry, programs, habits
    'aten::conv3d.default',  # registry, habits
    'aten::conv_transpose2d.input',  # registry, habits
    'aten::convolution.default',  # registry, programs, habits
    'aten::dist.default',  # habits
    'aten::einsum.default',  # registry, habits
    'aten::im2col.default',  # habits
    'aten::linalg_vector_norm.default',  # habits
    'aten::linear.default',  # registry, habits
    'aten::matmul.default',  # habits
    'aten::mm.default',  # habits
    'aten::mv.default',  # habits
    'aten::outer.default',  # habits
    'aten::resolve_conj.default',  # programs, habits
    'aten::resolve_neg.default',  # programs, habits

    # Normalisation layers. native_batch_norm is what batch_norm dispatches to under
    # inference_mode; it trusts its statistics' sizes, so check_arguments checks them first
    # (CALL_CHECKS).
    'aten::batch_norm.default',  # registry, programs, habits
    'aten::group_norm.default',  # registry, habits
    'aten::instance_norm.default',  # habits
    'aten::layer_norm.default',  # registry, habits
    'aten::native_batch_norm.default',  # registry, programs, habits
    'aten::native_group_norm.default',  # registry, habits
    'aten::native_layer_norm.default',  # registry, habits

    # Activations, softmax and their in-place forms.
    'aten::_log_softmax.default',  # habits
    'aten::_prelu_kernel.default',  # habits
    'aten::_softmax.default',  # registry, programs, habits
    'aten::elu.default',  # habits
    'aten::gelu.default',  # registry, habits
    'aten::glu.default',  # habits
    'aten::hardsigmoid.default',  # registry, habits
    'aten::hardswish.default',  # habits
    'aten::hardswish_.default',  # registry, habits
    'aten::hardtanh.default',  # habits
    'aten::hardtanh_.default',  # registry, programs, habits
    'aten::leaky_relu.default',  # habits
    'aten::leaky_relu_.default',  # habits
    'aten::log_softmax.int',  # habits
    'aten::logsumexp.default',  # habits
    'aten::mish.default',  # habits
    'aten::prelu.default',  # habits
    'aten::relu.default',  # registry, programs, habits
    'aten::relu6.default',  # habits
    'aten::relu6_.default',  # habits
    'aten::relu_.default',  # registry, programs, habits
    'aten::selu.default',  # habits
    'aten::sigmoid.default',  # registry, programs, habits
    'aten::sigmoid_.default',  # habits
    'aten::silu.default',  # registry, programs, habits
    'aten::silu_.default',  # habits
    'aten::softmax.int',  # registry, habits
    'aten::softplus.default',  # habits
    'aten::tanh.default',  # habits

    # Attention (the CPU kernel is what the robot's dispatcher picks for
    # scaled_dot_product_attention).
    'aten::_scaled_dot_product_flash_attention_for_cpu.default',  # habits
    'aten::scaled_dot_product_attention.default',  # habits

    # Pooling, resizing, resampling and padding. grid_sampler's integer modes are checked
    # (CALL_CHECKS): an unknown one leaves the output unwritten.
    'aten::_adaptive_avg_pool2d.default',  # registry, habits
    'aten::adaptive_avg_pool1d.default',  # habits
    'aten::adaptive_avg_pool2d.default',  # registry, habits
    'aten::adaptive_max_pool2d.default',  # habits
    'aten::affine_grid_generator.default',  # habits
    'aten::avg_pool1d.default',  # habits
    'aten::avg_pool2d.default',  # registry, habits
    'aten::avg_pool3d.default',  # habits
    'aten::constant_pad_nd.default',  # habits
    'aten::grid_sampler.default',  # habits
    'aten::grid_sampler_2d.default',  # habits
    'aten::max_pool1d.default',  # habits
    'aten::max_pool2d.default',  # registry, programs, habits
    'aten::max_pool2d_with_indices.default',  # registry, programs, habits
    'aten::max_pool3d.default',  # habits
    'aten::max_pool3d_with_indices.default',  # habits
    'aten::pad.default',  # habits
    'aten::pixel_shuffle.default',  # habits
    'aten::pixel_unshuffle.default',  # habits
    'aten::reflection_pad2d.default',  # habits
    'aten::replication_pad2d.default',  # habits
    'aten::upsample_bicubic2d.default',  # habits
    'aten::upsample_bicubic2d.vec',  # habits
    'aten::upsample_bilinear2d.default',  # registry, habits
    'aten::upsample_bilinear2d.vec',  # registry, habits
    'aten::upsample_nearest2d.default',  # registry, habits
    'aten::upsample_nearest2d.vec',  # registry, programs, habits

    # Elementwise arithmetic, comparisons, bitwise and logical operators, rounding, clamping: pre-
    # and post-processing.
    'aten::__and__.Scalar',  # habits
    'aten::__and__.Tensor',  # registry, habits
    'aten::__lshift__.Scalar',  # habits
    'aten::__or__.Scalar',  # habits
    'aten::__or__.Tensor',  # habits
    'aten::__rshift__.Scalar',  # habits
    'aten::__xor__.Scalar',  # habits
    'aten::abs.default',  # habits
    'aten::acos.default',  # habits
    'aten::add.Scalar',  # habits
    'aten::add.Tensor',  # registry, programs, habits
    'aten::add_.Scalar',  # habits
    'aten::add_.Tensor',  # registry, programs, habits
    'aten::addcmul.default',  # habits
    'aten::allclose.default',  # habits
    'aten::asin.default',  # habits
    'aten::atan.default',  # habits
    'aten::atan2.default',  # habits
    'aten::bitwise_and.Scalar',  # habits
    'aten::bitwise_and.Tensor',  # registry, habits
    'aten::bitwise_and_.Tensor',  # habits
    'aten::bitwise_not.default',  # habits
    'aten::bitwise_or.Scalar',  # habits
    'aten::bitwise_or.Tensor',  # habits
    'aten::bitwise_or_.Tensor',  # habits
    'aten::bitwise_xor.Scalar',  # habits
    'aten::ceil.default',  # habits
    'aten::clamp.default',  # registry, habits
    'aten::clamp_.default',  # habits
    'aten::clamp_min.default',  # habits
    'aten::clip.default',  # habits
    'aten::cos.default',  # habits
    'aten::cosh.default',  # habits
    'aten::div.Tensor',  # registry, programs, habits
    'aten::div.Tensor_mode',  # registry
    'aten::div_.Scalar',  # habits
    'aten::div_.Tensor',  # habits
    'aten::eq.Scalar',  # registry
    'aten::eq.Tensor',  # registry, habits
    'aten::equal.default',  # habits
    'aten::erf.default',  # habits
    'aten::exp.default',  # registry, habits
    'aten::exp2.default',  # habits
    'aten::expm1.default',  # habits
    'aten::floor.default',  # registry, habits
    'aten::floor_divide.default',  # habits
    'aten::fmod.Scalar',  # habits
    'aten::frac.default',  # habits
    'aten::ge.Scalar',  # registry, habits
    'aten::ge.Tensor',  # habits
    'aten::gt.Scalar',  # registry, programs, habits
    'aten::gt.Tensor',  # habits
    'aten::hypot.default',  # habits
    'aten::isclose.default',  # habits
    'aten::isfinite.default',  # habits
    'aten::isinf.default',  # habits
    'aten::isnan.default',  # habits
    'aten::le.Scalar',  # habits
    'aten::le.Tensor',  # habits
    'aten::lerp.Scalar',  # habits
    'aten::log.default',  # habits
    'aten::log10.default',  # habits
    'aten::log1p.default',  # habits
    'aten::log2.default',  # registry, habits
    'aten::logical_and.default',  # habits
    'aten::logical_not.default',  # habits
    'aten::logical_or.default',  # habits
    'aten::logical_xor.default',  # habits
    'aten::lt.Scalar',  # habits
    'aten::lt.Tensor',  # habits
    'aten::maximum.default',  # habits
    'aten::minimum.default',  # habits
    'aten::mul.Scalar',  # habits
    'aten::mul.Tensor',  # registry, programs, habits
    'aten::mul_.Scalar',  # habits
    'aten::mul_.Tensor',  # habits
    'aten::nan_to_num.default',  # habits
    'aten::ne.Scalar',  # habits
    'aten::ne.Tensor',  # habits
    'aten::neg.default',  # habits
    'aten::pow.Scalar',  # habits
    'aten::pow.Tensor_Scalar',  # registry, programs, habits
    'aten::reciprocal.default',  # habits
    'aten::remainder.Scalar',  # registry, habits
    'aten::round.default',  # registry, habits
    'aten::rsqrt.default',  # habits
    'aten::rsub.Scalar',  # habits
    'aten::sgn.default',  # habits
    'aten::sign.default',  # habits
    'aten::sin.default',  # programs, habits
    'aten::sinh.default',  # habits
    'aten::sqrt.default',  # registry, habits
    'aten::square.default',  # habits
    'aten::sub.Tensor',  # registry, programs, habits
    'aten::sub_.Tensor',  # habits
    'aten::tan.default',  # habits
    'aten::trunc.default',  # habits
    'aten::where.ScalarOther',  # habits
    'aten::where.default',  # registry, habits
    'aten::where.self',  # habits

    # Reductions, sorting and selection (classification and detection heads). Their output sizes
    # follow from the input's, so the session's byte budget bounds them.
    'aten::_unique2.default',  # registry, habits
    'aten::all.default',  # habits
    'aten::amax.default',  # registry, habits
    'aten::amin.default',  # habits
    'aten::any.default',  # habits
    'aten::argmax.default',  # registry, programs, habits
    'aten::argsort.default',  # habits
    'aten::bucketize.Tensor',  # habits
    'aten::count_nonzero.default',  # habits
    'aten::cummax.default',  # habits
    'aten::cumprod.default',  # habits
    'aten::cumsum.default',  # habits
    'aten::diff.default',  # habits
    'aten::histc.default',  # habits
    'aten::kthvalue.default',  # habits
    'aten::masked_select.default',  # habits
    'aten::max.default',  # programs, habits
    'aten::max.dim',  # habits
    'aten::max.other',  # habits
    'aten::mean.default',  # programs, habits
    'aten::mean.dim',  # registry, programs, habits
    'aten::median.default',  # habits
    'aten::min.default',  # habits
    'aten::min.dim',  # habits
    'aten::min.other',  # habits
    'aten::nonzero.default',  # registry, habits
    'aten::nonzero_numpy.default',  # habits
    'aten::prod.dim_int',  # habits
    'aten::searchsorted.Tensor',  # habits
    'aten::sort.default',  # registry, habits
    'aten::std.correction',  # habits
    'aten::std.dim',  # habits
    'aten::std_mean.correction',  # habits
    'aten::std_mean.dim',  # habits
    'aten::sum.default',  # habits
    'aten::sum.dim_IntList',  # registry, habits
    'aten::topk.default',  # registry, programs, habits
    'aten::var.correction',  # habits
    'aten::var.dim',  # habits
    'aten::var_mean.correction',  # habits
    'aten::var_mean.dim',  # habits

    # Indexing, gather and scatter: every kernel checks its indices against the sizes.
    'aten::embedding.default',  # habits
    'aten::gather.default',  # habits
    'aten::index.Tensor',  # registry, habits
    'aten::index_add.default',  # habits
    'aten::index_copy.default',  # habits
    'aten::index_fill.int_Scalar',  # habits
    'aten::index_put_.default',  # registry, habits
    'aten::index_select.default',  # habits
    'aten::masked_fill.Scalar',  # registry, habits
    'aten::masked_fill_.Scalar',  # habits
    'aten::masked_scatter.default',  # habits
    'aten::scatter.value',  # habits
    'aten::scatter_.value',  # habits
    'aten::scatter_add.default',  # habits
    'aten::scatter_reduce.two',  # habits
    'aten::take.default',  # habits

    # Views, reshapes, dtype/device conversions and copies. as_strided/as_strided_ check the view
    # against the tensor's storage; to/_to_copy take only the wire's dtypes, the strided layout
    # and the server's device.
    'aten::_to_copy.default',  # registry, habits
    'aten::as_strided.default',  # habits
    'aten::as_strided_.default',  # registry
    'aten::cat.default',  # registry, programs, habits
    'aten::chunk.default',  # habits
    'aten::clone.default',  # registry, habits
    'aten::contiguous.default',  # registry, programs, habits
    'aten::copy_.default',  # registry, programs, habits
    'aten::detach.default',  # registry, programs, habits
    'aten::detach_.default',  # registry, habits
    'aten::diag.default',  # habits
    'aten::diag_embed.default',  # habits
    'aten::diagonal.default',  # habits
    'aten::expand.default',  # registry, programs, habits
    'aten::expand_as.default',  # registry, habits
    'aten::fill_.Scalar',  # registry, programs, habits
    'aten::fill_.Tensor',  # habits
    'aten::flatten.using_ints',  # registry, habits
    'aten::flip.default',  # habits
    'aten::lift_fresh.default',  # registry, programs, habits
    'aten::mT.default',  # habits
    'aten::meshgrid.indexing',  # registry, programs, habits
    'aten::movedim.int',  # habits
    'aten::narrow.default',  # registry, habits
    'aten::permute.default',  # registry, programs, habits
    'aten::repeat.default',  # habits
    'aten::repeat_interleave.self_int',  # habits
    'aten::reshape.default',  # registry, habits
    'aten::reshape_as.default',  # habits
    'aten::roll.default',  # habits
    'aten::select.int',  # registry, programs, habits
    'aten::slice.Tensor',  # registry, programs, habits
    'aten::split.Tensor',  # habits
    'aten::split_with_sizes.default',  # registry, habits
    'aten::squeeze.default',  # habits
    'aten::squeeze.dim',  # habits
    'aten::stack.default',  # registry, programs, habits
    'aten::t.default',  # registry, programs, habits
    'aten::tile.default',  # habits
    'aten::to.device',  # registry, programs, habits
    'aten::to.dtype',  # registry, habits
    'aten::to.dtype_layout',  # programs, habits
    'aten::transpose.int',  # habits
    'aten::tril.default',  # habits
    'aten::triu.default',  # habits
    'aten::type_as.default',  # habits
    'aten::unbind.int',  # registry, habits
    'aten::unflatten.int',  # habits
    'aten::unsqueeze.default',  # registry, programs, habits
    'aten::view.default',  # registry, programs, habits
    'aten::view_as.default',  # habits
    'aten::zero_.default',  # programs, habits

    # Factories and random numbers (initialised memory only: empty, empty_like and new_empty are
    # left out, their bytes could be another session's), and dropout in eval and train mode.
    'aten::alpha_dropout.default',  # habits
    'aten::arange.default',  # registry, programs, habits
    'aten::arange.start',  # registry
    'aten::arange.start_step',  # habits
    'aten::bernoulli.default',  # habits
    'aten::bernoulli_.float',  # habits
    'aten::dropout.default',  # registry, habits
    'aten::dropout_.default',  # registry
    'aten::eye.default',  # registry, habits
    'aten::eye.m',  # habits
    'aten::feature_dropout.default',  # habits
    'aten::full.default',  # registry, programs, habits
    'aten::full_like.default',  # registry, habits
    'aten::linspace.default',  # habits
    'aten::multinomial.default',  # habits
    'aten::new_full.default',  # registry, habits
    'aten::new_ones.default',  # habits
    'aten::new_zeros.default',  # habits
    'aten::normal.Tensor_float',  # habits
    'aten::normal_.default',  # programs, habits
    'aten::ones.default',  # programs, habits
    'aten::ones_like.default',  # habits
    'aten::rand.default',  # habits
    'aten::rand.generator',  # programs, habits
    'aten::rand_like.default',  # habits
    'aten::randint.low',  # habits
    'aten::randint.low_generator',  # habits
    'aten::randn.default',  # habits
    'aten::randn.generator',  # habits
    'aten::randn_like.default',  # habits
    'aten::randperm.default',  # habits
    'aten::scalar_tensor.default',  # habits
    'aten::uniform_.default',  # programs, habits
    'aten::zeros.default',  # registry, programs, habits
    'aten::zeros_like.default',  # registry, habits

    # A value back to the robot (.item(), a branch on a tensor).
    'aten::_local_scalar_dense.default',  # registry, programs, habits
    'aten::item.default',  # programs, habits

    # torchvision detection operators (Faster R-CNN, RetinaNet, user post-processing). roi_align
    # and roi_pool index the input by the box's batch number unchecked, so check_arguments checks
    # the boxes first (CALL_CHECKS).
    'torchvision::nms.default',  # registry, habits
    'torchvision::roi_align.default',  # registry, habits
    'torchvision::roi_pool.default',  # habits
})
