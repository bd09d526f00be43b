"""Int8 weights for inference (compute.weights="int8"), in two layers of the architecture:

    layers.py   the int8 numbers (quantize, dequantize, int8_linear) and the layers that read them
                (Int8Linear, Int8Embed): below the model, which picks them by compute.weights
    params.py   params in the form a compute config reads them (params_for, check_params): above
                the model, whose declarations say which params are matrices

The names below are imported from their module when first used, so that the model's import of
jaxgpt.quantize.layers never imports params.py (which imports the model).
"""

from jaxgpt.lazy import lazy_exports

_EXPORTS = {
    **{name: "jaxgpt.quantize.layers" for name in ("INT8_MAX", "quantize", "dequantize", "int8_linear",
                                                    "Int8Linear", "Int8Embed")},
    **{name: "jaxgpt.quantize.params" for name in ("params_for", "int8_shapes", "quantize_params", "check_params",
                                                    "quantize_matrix")},
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
