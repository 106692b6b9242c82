#!/usr/bin/env python3
"""Draws rubato_bench_attention_kascade's (decode) or rubato_bench_attention_kascade_prefill's
(prefill) JSON as a PNG with gnuplot: per context, the dense launch and Kascade's anchor 0,
anchor, reuse and mean per-layer times (ms; prefill: summed over the prompt's chunks).

  python3 bench/attention_kascade_plot.py bench/results/attention_kascade_h100.json
  python3 bench/attention_kascade_plot.py bench/results/attention_kascade_prefill_h100.json
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if shutil.which("gnuplot") is None:
        sys.exit("attention_kascade_plot.py: gnuplot not found (scripts/setup installs it)")
    png = path[:-len(".json")] + ".png"
    handle, data = tempfile.mkstemp(suffix=".dat")
    os.close(handle)
    columns = ["dense_ms", "anchor0_ms", "anchor_ms", "reuse_ms", "mean_layer_ms"]
    with open(data, "w", encoding="utf-8") as f:
        f.write('context dense "anchor 0" anchor reuse "mean per layer"\n')
        for point in report["points"]:
            if "error" in point:
                continue
            f.write(f"{point['context'] // 1024}K " +
                    " ".join(f"{point[c]:.5f}" for c in columns) + "\n")
    prefill = report.get("benchmark") == "attention_kascade_prefill"
    title = (f"Kascade {'prefill' if prefill else 'decode'} attention per layer, "
             f"{report['device']}, batch {report['batch']}, "
             f"anchors {report['anchors']} of {report['layers']}")
    ylabel = "ms per layer, summed over the chunks" if prefill else "ms per layer"
    script = "\n".join([
        "set terminal pngcairo size 1000,500 font 'sans,10'",
        f"set output '{png}'",
        f"set title \"{title}\" noenhanced",
        "set style data histograms", "set style histogram clustered gap 1",
        "set style fill solid 0.8 border -1", f"set ylabel '{ylabel}'", "set key top left",
        "plot " + ", ".join(f"'{data}' using {i + 2}:xtic(1) title columnhead"
                            for i in range(len(columns)))])
    try:
        subprocess.run(["gnuplot"], input=script, text=True, check=True)
    finally:
        os.remove(data)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
