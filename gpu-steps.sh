source scripts/gpu/env.sh
B=build-gpu
STAGES="build tokens" BUILD_TARGETS="gpu_ops_test gpu_model_test rubato rubato_bench_decode_e2e rubato_bench_prefill" bash scripts/gpu/run 2>&1 | tail -8
mkdir -p $OUT/logs; cp -r $OUT/logs $OUT/logs_build 2>/dev/null
DEV="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
E2E=$B/bench/rubato_bench_decode_e2e
M=configs/models/qwen3-8b
timeout 120 $B/tests/gpu/gpu_ops_test --gtest_filter='QkRope*:*Elementwise*:*Gemm*:*Linear*' > $OUT/logs/ops.log 2>&1; echo "ops rc=$? $(grep -c '^\[       OK' $OUT/logs/ops.log) ok"; grep "^\[  FAILED" $OUT/logs/ops.log | head
timeout 150 $B/tests/gpu/gpu_model_test --gtest_filter='*Golden*:CudaModelTest.*' > $OUT/logs/model.log 2>&1; echo "model rc=$? $(grep -c '^\[       OK' $OUT/logs/model.log) ok"; grep "^\[  FAILED" $OUT/logs/model.log | head
for tune in 0 1; do for model in qwen3-8b qwen3-4b; do
  RUBATO_GEMM_TUNE=$tune timeout 100 $E2E --config configs/models/$model --points 1x4096,1x32768,4x8192,16x8192,64x2048 \
    --block-size 64 --steps 20 --warmup 3 --commit $COMMIT --out $OUT/decode_e2e_small_${model}_tune$tune.json > $OUT/logs/e2e_${model}_tune$tune.log 2>&1
  echo "tune=$tune $model"; tail -6 $OUT/logs/e2e_${model}_tune$tune.log
done; done
timeout 150 ncu --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --log-file $OUT/logs/ncu_1x4096.csv \
    $E2E --config $M --points 1x4096 --block-size 64 --steps 10 --warmup 3 --profile-steps 2 \
    --commit $COMMIT --out $OUT/logs/e2e_ncu_1x4096.json > $OUT/logs/ncu_1x4096.log 2>&1
python3 bench/kernel_breakdown.py --csv $OUT/logs/ncu_1x4096.csv --steps 2 \
    --e2e $OUT/decode_e2e_small_qwen3-8b_tune1.json --point 0 --out $OUT/kernel_breakdown_qwen3-8b_1x4096.json 2>&1 | tail -22
timeout 120 $B/bench/rubato_bench_prefill --config $M --prompts 4096,32768 --chunks 512,2048,8192 \
  --repeats 2 --commit $COMMIT --out $OUT/prefill_qwen3-8b.json > $OUT/logs/prefill.log 2>&1
echo "prefill rc=$?"; tail -12 $OUT/logs/prefill.log
timeout 200 python3 scripts/gpu/serve_scale.py --rubato $B/inference_rank/rubato --config-dir $M \
  --device "$DEV" --commit $COMMIT --log $OUT/logs/serve_scale.log --out $OUT/serve_scale_qwen3-8b.json
timeout 60 $E2E --config $M --points 1x1152,16x1152,64x1152,256x1152 --block-size 16 --steps 20 --warmup 3 \
  --commit $COMMIT --out $OUT/decode_e2e_serve_points_qwen3-8b.json > $OUT/logs/e2e_serve_points.log 2>&1
tail -6 $OUT/logs/e2e_serve_points.log
cd $OUT && tar czf logs.tgz logs logs_build && rm -rf logs logs_build
