set -x
source scripts/gpu/env.sh
B=build-gpu
STAGES=build BUILD_TARGETS="rubato rubato_bench_decode_e2e rubato_bench_prefill" bash scripts/gpu/run
mkdir -p $OUT/logs
cp -r $OUT/logs $OUT/logs_build 2>/dev/null
DEV="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
E2E=$B/bench/rubato_bench_decode_e2e
M=configs/models/qwen3-8b
# 1. small-batch points, 8B and 4B
for model in qwen3-8b qwen3-4b; do
  timeout 120 $E2E --config configs/models/$model --points 1x4096,1x32768,4x8192,16x8192,64x2048 \
    --block-size 64 --steps 20 --warmup 3 --commit $COMMIT --out $OUT/decode_e2e_small_$model.json > $OUT/logs/e2e_small_$model.log 2>&1
  tail -8 $OUT/logs/e2e_small_$model.log
done
# 2. per-kernel breakdown under ncu
for p in 1x4096 64x2048; do
  timeout 200 ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file $OUT/logs/ncu_$p.csv \
    $E2E --config $M --points $p --block-size 64 --steps 10 --warmup 3 --profile-steps 2 \
    --commit $COMMIT --out $OUT/logs/e2e_ncu_$p.json > $OUT/logs/ncu_$p.log 2>&1
  echo "ncu $p rc=$?"
  python3 bench/kernel_breakdown.py --csv $OUT/logs/ncu_$p.csv --steps 2 \
    --e2e $OUT/decode_e2e_small_qwen3-8b.json --point $([ $p = 1x4096 ] && echo 0 || echo 4) \
    --out $OUT/kernel_breakdown_qwen3-8b_$p.json 2>&1 | tail -25
done
# 3. prefill
timeout 150 $B/bench/rubato_bench_prefill --config $M --prompts 4096,32768 --chunks 512,2048,8192 \
  --repeats 2 --commit $COMMIT --out $OUT/prefill_qwen3-8b.json > $OUT/logs/prefill.log 2>&1
echo "prefill rc=$?"; tail -20 $OUT/logs/prefill.log
# 4. serving at scale, and the engine's step at the same batches
timeout 240 python3 scripts/gpu/serve_scale.py --rubato $B/inference_rank/rubato --config-dir $M \
  --device "$DEV" --commit $COMMIT --log $OUT/logs/serve_scale.log --out $OUT/serve_scale_qwen3-8b.json
echo "serve rc=$?"
timeout 100 $E2E --config $M --points 1x1152,16x1152,64x1152,256x1152 --block-size 16 --steps 20 --warmup 3 \
  --commit $COMMIT --out $OUT/decode_e2e_serve_points_qwen3-8b.json > $OUT/logs/e2e_serve_points.log 2>&1
tail -7 $OUT/logs/e2e_serve_points.log
cd $OUT && tar czf logs.tgz logs logs_build && rm -rf logs logs_build
