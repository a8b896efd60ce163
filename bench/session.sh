#!/usr/bin/env bash
# The GPU runs that belong together, one step per device call (each bounded to fit one call's 600 s).
# Usage on the device (after ../shared/tools/device-prep here; carry .whl and .data):
#   bash bench/session.sh s15e|s15d|s15c|s15b|s15a|s14g|s14f|s14e|s14d|s14c|s14b|s14a|s13e|s13d|s13c|s13b|s12d|s12c|s12b|s12a|s11e|s11d|s11c|s11b|s11a|s10-300m|s10-final|s10-8b|s10b|s10|s10-attn|s9-parity|s9-8b|s9b|s9|tma|s8-resid2|s8-resid|s8-copies|s8-e2e|s8-38b|s8-perseq|s8-probe|s7-cache|s7-38b|s7-vit|s7-e2e|s7-probe|probe-dec|try-8b|ragged|fused|margins|parity|parity-e2e|parity38-e2e|e2e-both|final|probe-llm|probe-vit|parts|vit64-modes|e2e-cudnn|e2e-38b|e2e-8b-overlap|fp8|fp8-bench|fp8-e2e|attn-8b|e2e-8b-hf64|vit64|vit|e2e|e2e-fast|e2e-8b
# Full logs land in $OUT (when set); each step ends with the table to copy into bench/RESULTS.md.
set -u
what=${1:?s15e|s15d|s15c|s15b|s15a|s14g|s14f|s14e|s14d|s14c|s14b|s14a|s13e|s13d|s13c|s13b|s12d|s12c|s12b|s12a|s11e|s11d|s11c|s11b|s11a|s10-300m|s10-final|s10-8b|s10b|s10|s10-attn|s9-parity|s9-8b|s9b|s9|tma|s8-resid2|s8-resid|s8-copies|s8-e2e|s8-38b|s8-perseq|s8-probe|s7-cache|s7-38b|s7-vit|s7-e2e|s7-probe|probe-dec|try-8b|ragged|fused|margins|parity|parity-e2e|parity38-e2e|e2e-both|final|probe-llm|probe-vit|parts|vit64-modes|e2e-cudnn|e2e-38b|e2e-8b-overlap|fp8|fp8-bench|fp8-e2e|attn-8b|e2e-8b-hf64|vit64|vit|e2e|e2e-fast|e2e-8b}
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
case $what in
s15e)  # session 15: the 8B seed job at HEAD against transformers, as s13d (~4.5 min with the start)
  timeout 200 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'stages|^\||ceiling|RESULT|Error|greedy' ;;
s15d)  # session 15, last call: both encoders at 64 tiles, the do_bench floor and ours read five times in turn, on
  # another machine start (~5 min with the start)
  timeout 330 python3 bench/vit.py --batches 64 --mode default --skip-hf --rounds 5 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error' ;;
s15c)  # session 15: GPU parity of the 38B preset (the 6B's Triton q/k RMSNorm), then the 38B seed job's rows without
  # caches, 250 requests (~6 min with the start)
  timeout 150 python3 bench/gpu_parity.py internvl2_5-38b 2>&1 | tee "$out/parity.log" | grep -E 'ViT|greedy|FAIL|Error|error'
  timeout 300 python3 bench/e2e.py --n 250 --modes nocache 2>&1 | tee "$out/e2e_38b.log" \
    | grep -E 'compiled|stages|^\||ceiling|RESULT|Error|error' ;;
s15b)  # session 15, HEAD (the 6B's q/k RMSNorm in Triton): issue 4's table, both encoders at 16 / 64 / 128 tiles, ours
  # and transformers (compiled in Inductor's default mode), the do_bench floor and ours read three times in turn
  # (~10 min with the start)
  timeout 540 python3 bench/vit.py --batches 16,64,128 --mode default --hf-mode default --rounds 3 --budget-s 420 \
    2>&1 | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|skipped|Error|error' ;;
s15a)  # session 15: the 6B's q/k RMSNorm as one Triton pass per part vs Inductor's reductions (the op alone, then the
  # compiled 6B interleaved), then both encoders at 64 tiles (also --sdpa-attn: the 6B's old norm) with the do_bench
  # floor and ours read three times in turn (~8 min with the start)
  timeout 200 python3 bench/probe.py qknormab 2>&1 | tee "$out/probe_qknormab.log" | grep -E '^\||Error|error'
  timeout 330 python3 bench/vit.py --batches 64 --mode default --skip-hf --sdpa-attn --rounds 3 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error' ;;
s14g)  # session 14: the 38B seed job's rows without caches (250 requests), through the runner's ViT as it now builds
  # it (layer scales folded into the model's weights, the 6B's residuals in place) (~5.5 min with the start)
  timeout 330 python3 bench/e2e.py --n 250 --modes nocache 2>&1 | tee "$out/e2e_38b.log" \
    | grep -E 'compiled|stages|^\||ceiling|RESULT|Error|error' ;;
s14f)  # session 14, last call: HEAD's encoders at 64 tiles again on another machine start (~3.5 min with the start)
  timeout 200 python3 bench/vit.py --batches 64 --mode default --skip-hf 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error' ;;
s14e)  # session 14, HEAD (the 6B's residuals in place, layer scales folded into its weights): GPU parity of both
  # presets, then both encoders at 16 / 64 / 128 tiles, ours only (~8.5 min with the start)
  timeout 150 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E 'ViT|greedy|FAIL|Error|error'
  timeout 300 python3 bench/vit.py --batches 16,64,128 --mode default --skip-hf 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error' ;;
s14d)  # session 14 (time_calls now syncs first): the 6B at 64 tiles with and without its residuals in place, in
  # vit.py's frame (3 s windows), then interleaved A B B A (~5 min with the start)
  timeout 240 python3 bench/vit.py --models 6b --batches 64 --mode default --skip-hf --inplace-residual --target-s 3 \
    2>&1 | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error'
  timeout 150 python3 bench/probe.py inplaceab 2>&1 | tee "$out/probe_inplaceab.log" | grep -E '^\||Error|error' ;;
s14c)  # session 14: the same compiled encoders timed under no_grad, inference_mode and do_bench, in turn, with kernel
  # time by kind per way (~3.5 min with the start); clock and power sampled
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 200 > "$out/smi.csv" 2>&1 &
  smi=$!
  timeout 200 python3 bench/probe.py howtimed 2>&1 | tee "$out/probe_howtimed.log" | grep -E '^\||Error|error'
  kill $smi ;;
s14b)  # session 14: why the compiled 6B read 34 tiles/s in s14a (52 in sessions 12-13): cuDNN version, the 6B's
  # compiled layer by kernel kind (8 layers), then the 6B at 64 tiles against its floors; clock and power sampled
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 200 > "$out/smi.csv" 2>&1 &
  smi=$!
  python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
  nvidia-smi -q -d POWER,CLOCK | grep -iE 'limit|max|current' | head -20
  timeout 150 python3 bench/probe.py vit6b 2>&1 | tee "$out/probe_vit6b.log" | grep -vE '^\s*$' | head -45
  timeout 200 python3 bench/vit.py --models 6b --batches 64 --mode default --skip-hf 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error'
  kill $smi ;;
s14a)  # session 14: TunableOp on this build (its solutions; the ViT GEMMs and the compiled encoders off vs on,
  # interleaved), then the compiled 6B with residual_norm vs residuals in place, interleaved; SM clock and power
  # sampled every 200 ms throughout (~6 min with the start)
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 200 \
    > "$out/smi.csv" 2>&1 &
  smi=$!
  timeout 200 python3 bench/probe.py tunab 2>&1 | tee "$out/probe_tunab.log" | grep -E '^\||^results|Error|error'
  timeout 120 python3 bench/probe.py inplaceab 2>&1 | tee "$out/probe_inplaceab.log" | grep -E '^\||Error|error'
  kill $smi ;;
s13e)  # session 13: the compiled 300M with the old vs new shift-mode norm launch, interleaved (~3 min with the start)
  timeout 150 python3 bench/probe.py shiftab 2>&1 | tee "$out/probe_shiftab.log" | grep -E '^\||Error|error' ;;
s13d)  # session 13, last call (~11 min with the start): the shift-mode norm with 2048 columns per program (the 300M's
  # in-place path), both encoders at 16 / 64 / 128 tiles (ours only), GPU parity of both presets, the 8B seed job
  timeout 300 python3 bench/vit.py --batches 16,64,128 --mode default --skip-hf 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|Error|error'
  timeout 150 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E 'ViT|greedy|FAIL|Error|error'
  timeout 150 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'stages|^\||ceiling|RESULT|Error|greedy' ;;
s13c)  # session 13: the row passes by rows per program and warps, the 300M's GEMM epilogues, then the 300M's compiled
  # layer by kernel (8 layers, 64 tiles) (~3 min)
  timeout 120 python3 bench/probe.py passes 2>&1 | tee "$out/probe_passes.log" | grep -E '^\||Error|error'
  timeout 150 python3 bench/probe.py vit300 2>&1 | tee "$out/probe_vit300.log" | grep -vE '^\s*$' | head -60 ;;
s13b)  # session 13: the ViT GEMMs under cuBLAS, cuBLASLt and TunableOp; then issue 4's comparison at 64 tiles
  # against transformers compiled in the seed's mode (max-autotune-no-cudagraphs), with the FP8 stretch row (~9 min)
  timeout 100 python3 bench/probe.py blas 2>&1 | tee "$out/probe_blas.log" | grep -E '^\||^default|Error|error'
  timeout 420 python3 bench/vit.py --batches 64 --mode default --hf-mode max-autotune-no-cudagraphs --fp8 \
    --budget-s 330 2>&1 | tee "$out/vit.log" | grep -E '^\||floor as one|rel. error|fp8|skipped|Error|error' ;;
s12d)  # session 12, last call (~5 min with the start): the 8B job again, both encoders at 16 / 64 tiles with ~1 s
  # timing windows (no transformers rows), then the host's share of the compiled 300M's small-batch time
  timeout 150 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'stages|^\||ceiling|RESULT|Error|greedy'
  timeout 140 python3 bench/vit.py --batches 16,64 --mode default --skip-hf --max-iters 400 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|Error|error'
  timeout 60 python3 bench/probe.py vithost 2>&1 | tee "$out/probe_vithost.log" | grep -E '^\||Error|error' ;;
s12c)  # session 12: the 38B seed job without caches, with both caches, and transformers b=16 in one run (~6 min), then
  # 8B GPU parity alone (its inputs now drawn as in the two-preset run) (~1 min)
  timeout 440 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,cache,hf 2>&1 \
    | tee "$out/e2e_38b.log" | grep -E 'stages|graphs captured|windows|^\||ceiling|RESULT|Error|greedy'
  timeout 80 python3 bench/gpu_parity.py internvl2_5-8b 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s12b)  # session 12: issue 4's table (both encoders at 16 / 64 / 128 tiles, ours and transformers, with the floor also
  # timed as one sustained forward), then more Triton attention configs at head_dim 128 (6B) (~9 min)
  timeout 440 python3 bench/vit.py --batches 16,64,128 --mode default --hf-mode default --budget-s 380 2>&1 \
    | tee "$out/vit.log" | grep -E '^\||floor as one|Error|error'
  timeout 120 python3 bench/probe.py vitattn internvl2_5-38b 2>&1 | tee "$out/probe_vitattn.log" | grep -E '^\||^#|Error|error' ;;
s12a)  # session 12, first call (~6 min with the start): the 8B job at HEAD (session 11's last commits: the arena's
  # per-batch clear off under the decode kernel), 8B GPU parity, then the compiled encoders plain vs CUDA-graphed
  timeout 150 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'stages|^\||ceiling|RESULT|Error|greedy'
  timeout 70 python3 bench/gpu_parity.py internvl2_5-8b 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error'
  timeout 200 python3 bench/probe.py vitgraph 2>&1 | tee "$out/probe_vitgraph.log" | grep -E '^\||Error|error' ;;
s11a)  # session 11: the 300M Triton attention with own keys first vs in order; decode attention (Triton split-key
  # kernel vs masked SDPA) alone; GPU parity of every fast path (~7 min)
  timeout 120 python3 bench/probe.py vitattn internvl2_5-8b 2>&1 | tee "$out/probe_vitattn.log" | grep -E '^\||^#|Error|error'
  timeout 100 python3 bench/probe.py decattn 2>&1 | tee "$out/probe_decattn.log" | grep -E '^\||^#|Error|error'
  timeout 320 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s11e)  # session 11, the last call (~3 min with the start): the 8B job at the final commit, then 8B GPU parity
  timeout 130 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'stages|^\||ceiling|RESULT|Error|greedy'
  timeout 50 python3 bench/gpu_parity.py internvl2_5-8b 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s11d)  # session 11: the 8B job with the last layer (compiled) for last tokens only vs for all, then the 38B job
  # without caches vs transformers b=16 (~9.5 min)
  timeout 240 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,nocache-fulllast,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error|skips'
  timeout 345 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf 2>&1 | tee "$out/e2e_38b.log" \
    | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error|skips' ;;
s11c)  # session 11: GPU parity (decode attention kernel, the last layer for last tokens only), the 300M attention
  # probe at the final kernel, then the 8B job with the last layer for last tokens only vs for all (~8 min)
  timeout 200 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error'
  timeout 60 python3 bench/probe.py vitattn internvl2_5-8b 2>&1 | tee "$out/probe_vitattn.log" | grep -E '^\||^#|Error|error'
  timeout 330 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,nocache-fulllast,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error|skips' ;;
s11b)  # session 11: the 8B seed job without caches vs transformers b=32 (~6 min), then the 300M at 16 / 64 / 128
  # tiles, no transformers rows (~2.5 min)
  timeout 390 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error'
  timeout 190 python3 bench/vit.py --models 300m --batches 16,64,128 --mode default --skip-hf 2>&1 \
    | tee "$out/vit_300m.log" | grep -E '^\||tiles/s|Error|error' ;;
s10-300m)  # the 300M encoder at 16, 64 and 128 tiles with session 10's defaults (Triton attention + residuals in
  # place), no transformers rows (~3 min with the machine start)
  timeout 170 python3 bench/vit.py --models 300m --batches 16,64,128 --mode default --skip-hf 2>&1 \
    | tee "$out/vit_300m.log" | grep -E '^\||tiles/s|Error|error' ;;
s10-final)  # the 300M's Triton attention at the final commit (warp-specialize / partial-first knobs removed) (~1 min)
  timeout 120 python3 bench/probe.py vitattn internvl2_5-8b 2>&1 | tee "$out/probe_vitattn.log" | grep -E '^\||^#|Error|error' ;;
s10-8b)  # the 8B seed job without caches vs transformers b=32 at session 10's defaults (300M: Triton attention,
  # residuals in place) (~6 min)
  timeout 420 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s10b)  # session 10: the Triton ViT attention's CLS partial before vs after the key loop (300M), the 300M at 64 tiles
  # (default, SDPA attention only, in place + Triton attention), then GPU parity (~6 min)
  timeout 120 python3 bench/probe.py vitattn internvl2_5-8b 2>&1 | tee "$out/probe_vitattn.log" | grep -E '^\||^#|Error|error'
  timeout 200 python3 bench/vit.py --models 300m --batches 64 --mode default --skip-hf --sdpa-attn --inplace-residual 2>&1 \
    | tee "$out/vit_attn.log" | grep -E '^\||Error|error'
  timeout 300 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s10)  # session 10: both ViTs at 64 tiles, default (Triton attention where configured) vs SDPA attention only (no
  # transformers), then GPU parity of every fast path (~8 min)
  timeout 270 python3 bench/vit.py --batches 64 --mode default --skip-hf --sdpa-attn 2>&1 \
    | tee "$out/vit_attn.log" | grep -E '^\||rel. error|tiles/s|Error|error'
  timeout 300 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s10-attn)  # session 10: the Triton ViT attention (CLS-aware, qk-norm folded) vs Inductor qk-norm + cuDNN (~2 min)
  timeout 300 python3 bench/probe.py vitattn 2>&1 | tee "$out/probe_vitattn.log" | grep -E '^\||^#|Error|error' ;;
s9-parity)  # GPU parity of every fast path, now with the opt-in in-place ViT residual row (~4 min)
  timeout 300 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s9-8b)  # the 8B seed job without caches vs transformers b=32 at the session's final defaults (~6 min)
  timeout 400 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s9b)  # the ViTs with the residuals added in place by the GEMMs vs today's compiled encoder (64 tiles, no
  # transformers), then GPU parity of every fast path (~7 min)
  timeout 240 python3 bench/vit.py --batches 64 --mode default --skip-hf --inplace-residual 2>&1 \
    | tee "$out/vit_inplace.log" | grep -E '^\||rel. error|tiles/s|Error|error'
  timeout 300 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
s9)  # session 9: the ViTs with norms / residuals / GELU in Triton GEMM epilogues vs today's compiled encoder (64
  # tiles, no transformers), then the TMA GEMM probe, then the residual add as cuBLAS's C in place (~9 min)
  timeout 300 python3 bench/vit.py --batches 64 --mode default --skip-hf --epilogue-gemm 2>&1 | tee "$out/vit_epi.log" \
    | grep -E '^\||rel. error|tiles/s|Error|error'
  timeout 190 python3 bench/probe.py tma 2>&1 | tee "$out/probe_tma.log" | grep -E '^\||^  |Error|error'
  timeout 90 python3 bench/probe.py inplace 2>&1 | tee "$out/probe_inplace.log" | grep -E '^\||^  |Error|error' ;;
tma)  # ran once, in s9 at 5c5987d, up to its second row (a config too large for the epilogue; fixed in d5ab4b7,
  # not re-run): can a persistent TMA Triton GEMM reach
  # cuBLAS at the ViT's and the 8B LLM's shapes: plain, with the residual + layer-scale epilogue, with an RMSNorm
  # prologue (A tiles normalized on load)? (~4 min)
  timeout 400 python3 bench/probe.py tma 2>&1 | tee "$out/probe_tma.log" | grep -E '^\||^  |Error|error' ;;
s8-resid2)  # one compiled 8B layer with only the attention residual unfused (~2 min; run at 6114fd8, since reverted)
  timeout 150 python3 bench/probe.py llm-layer 2>&1 | tee "$out/probe_llm_layer.log" | grep -vE "code:|Warning|warn" | grep -E "^##|nvjet|Memcpy|triton|cudnn|Cat" ;;
s8-resid)  # after the residual adds left addmm (run at 97a0661, since reverted): one compiled 8B layer's kernels, GPU
  # parity of every fast path, then the 8B seed job without caches vs transformers b=32 (~7 min)
  timeout 120 python3 bench/probe.py llm-layer 2>&1 | tee "$out/probe_llm_layer.log" | grep -vE 'code:|Warning|warn' | grep -E '^##|nvjet|Memcpy|triton|cudnn|Cat'
  timeout 200 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error'
  timeout 330 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s8-copies)  # where one compiled 8B decoder layer's five device-to-device copies come from (its code, host ops)
  timeout 150 python3 bench/probe.py llm-layer 2>&1 | tee "$out/probe_llm_layer.log" | grep -E 'code:|calls|^##' ;;
s8-e2e)  # one compiled 8B decoder layer's kernels (one cat per prefill, v contiguous in the RoPE pass), then the 8B
  # seed job without caches vs transformers b=32 (~7 min)
  timeout 120 python3 bench/probe.py llm-layer 2>&1 | tee "$out/probe_llm_layer.log" | grep -vE 'Warning|warn' | tail -30
  timeout 400 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s8-38b)  # the 38B seed job without caches vs transformers b=16 (~5 min; not run in session 8: device time spent)
  timeout 400 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf 2>&1 \
    | tee "$out/e2e_38b_nocache.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s8-perseq)  # per-sequence cuDNN prefill attention over the 8B job's first batch: a copy per sequence vs one cat (~1 min)
  timeout 200 python3 bench/probe.py perseq 2>&1 | tee "$out/probe_perseq.log" | grep -E '^\||^#|Error|error' ;;
s8-probe)  # ViT attention at T = 1025 vs 1024 and the CLS token out of the fused call (log-sum-exp merge), then one
  # compiled 8B decoder layer over the seed job's first batch with its kernels (~3 min)
  timeout 200 python3 bench/probe.py cls 2>&1 | tee "$out/probe_cls.log" | grep -E '^\||^#|Error|error'
  timeout 200 python3 bench/probe.py llm-layer 2>&1 | tee "$out/probe_llm_layer.log" | grep -vE 'Warning|warn' | tail -40 ;;
s7-cache)  # the first half of s7-e2e again (its transformers run had hit OOM beside the last engine's KV arena;
  # e2e.py now frees it first); run at 96cc05e as this command directly (~2 min)
  timeout 330 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes cache,hf \
    2>&1 | tee "$out/e2e_38b.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
s7-38b)  # the 38B seed job without caches vs transformers b=16 (run at 96cc05e as this command directly, ~5 min)
  timeout 340 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf 2>&1 \
    | tee "$out/e2e_38b_nocache.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s7-vit)  # issue 4's table with today's defaults (fused residual norm, exact buckets): both encoders at 16/64/128
  # tiles, ours eager / compiled vs transformers eager / compiled (~9 min)
  timeout 570 python3 bench/vit.py --batches 16,64,128 --mode default --hf-mode default --budget-s 490 \
    2>&1 | tee "$out/vit.log" | grep -E 'tiles/s|floor|compile|^\||Error|error' | tail -40 ;;
s7-e2e)  # 38B with caches vs transformers b=16 (the 15x target, last run in session 2), then the 8B seed job
  # without caches vs transformers b=32 (~8 min)
  timeout 250 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes cache,hf \
    2>&1 | tee "$out/e2e_38b.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error'
  timeout 330 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
s7-probe)  # parity of every fast path (logits now float32 from the GEMM on CUDA), then the MLP's gate/up GEMM with
  # SiLU * up in a Triton epilogue vs cuBLAS + a pass, then batched padded cuDNN prefill attention vs per sequence
  # and the float32-out lm_head product (~6 min)
  timeout 200 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error'
  timeout 200 python3 bench/probe.py swiglu 2>&1 | tee "$out/probe_swiglu.log" | grep -E '^\||Error|error'
  timeout 150 python3 bench/probe.py padded 2>&1 | tee "$out/probe_padded.log" | grep -E '^\||rows|err|Error' ;;
margins)  # 38B parity only, with where bf16 greedy tokens leave fp32's (top-2 margins, padded lm_head or not)
  timeout 150 python3 bench/gpu_parity.py internvl2_5-38b 2>&1 | tee "$out/parity.log" | grep -E '^\||step|Error|error' ;;
fused)  # parity of every fast path (now with the fused residual norm), then both encoders at 64 tiles: ours
  # compiled (default) vs multi-kernel reductions vs the Triton residual-norm pass, no transformers (~5 min)
  timeout 170 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|'
  # (run at 25a4dee, when the pass was opt-in as --fused-norm; now it is the default and --unfused-norm the other)
  timeout 380 python3 bench/vit.py --batches 64 --mode default --vs-mode multi-kernel --unfused-norm --skip-hf \
    --budget-s 320 2>&1 | tee "$out/vit.log" | grep -E 'floor|compile|^\||attention|Error|error' | tail -30 ;;
ragged)  # LLM prefill attention over the 8B job's batches: one ragged cuDNN call vs per sequence vs flash varlen
  timeout 300 python3 bench/probe.py ragged 2>&1 | tee "$out/probe_ragged.log" | grep -E '^\||^#|schema|Error|error' ;;
try-8b)  # the residual in the ViT's GEMMs (probe), then the 8B seed job with the next batch's ViT under this
  # batch's prefill (+prefetch) vs not, no transformers run (~4 min warm)
  timeout 150 python3 bench/probe.py resid 2>&1 | tee "$out/probe_resid.log" | grep -E '^\||Error|error'
  timeout 400 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --budget 65536 --modes nocache,nocache+prefetch \
    2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
probe-dec)  # the 8B decode step (graphed ms/step, kernels of a step, lm_head padded vs not), then the 300M ViT's
  # kernels at 64 tiles against its floor parts (~3 min)
  timeout 200 python3 bench/probe.py decode 2>&1 | tee "$out/probe_decode.log" | grep -E '^\||^#|Error|error'
  timeout 200 python3 bench/probe.py vit300 2>&1 | tee "$out/probe_vit300.log" | grep -vE 'Warning|warn' | tail -45 ;;
parity)  # bf16 fast paths vs fp32 on the same weights (~90 s)
  timeout 560 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|' ;;
probe-llm)  # parity of every fast path, then decode eager vs CUDA graphs vs compiled layers at 64 layers
  timeout 250 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|'
  timeout 300 python3 bench/probe.py llm 2>&1 | tee "$out/probe_llm.log" | grep -E '^\||^#|captured|floor|Error' ;;
parts)  # the ViT pieces above the floor alone, then the 8B LLM's packed prefill profile
  timeout 330 python3 bench/probe.py parts 2>&1 | tee "$out/probe_parts.log" | grep -E '^\||^#|Error' 
  timeout 200 python3 bench/profile_llm.py --preset internvl2_5-8b --layers 8 --batch 32 --compile-llm 1 2>&1 \
    | tee "$out/profile_llm_8b.log" | grep -vE 'Warning|warn' | tail -45 ;;
probe-vit)  # where ViT time above the floor goes: both encoders @ 64 tiles, 8 layers, kernel kinds vs floor parts
  timeout 300 python3 bench/probe.py vit 2>&1 | tee "$out/probe_vit.log" | grep -vE 'Warning|warn' | tail -120
  # and the 8B LLM's packed prefill (compiled layers, 64k tokens, 8 layers): what is left beside the GEMMs
  timeout 200 python3 bench/profile_llm.py --preset internvl2_5-8b --layers 8 --batch 32 --compile-llm 1 2>&1 \
    | tee "$out/profile_llm_8b.log" | grep -vE 'Warning|warn' | tail -40 ;;
vit64-modes)  # parity of every fast path, then both encoders at 64 tiles: ours eager / compiled (tuned; the engine's
  # default at 93d2a43) / compiled (default mode), transformers eager and compiled
  timeout 130 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|'
  timeout 420 python3 bench/vit.py --batches 64 --mode tuned --vs-mode default --hf-mode default --budget-s 330 \
    2>&1 | tee "$out/vit.log" | grep -E 'floor|compile|^\||attention' | tail -30 ;;
e2e-8b-overlap)  # 8B seed job: the ViT under the previous batch's decode (overlap_vit, never measured) vs not,
  # vs transformers b=32 (~6 min)
  timeout 400 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,nocache+overlap,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error' ;;
fp8)  # FP8 linears on this GPU/torch: row-wise _scaled_mm eager and compiled, ViT GEMM shapes vs bf16 (~1 min)
  timeout 100 python3 bench/probe.py fp8 2>&1 | tee "$out/probe_fp8.log" | grep -E '^\||Error|error' ;;
fp8-bench)  # the FP8 ViT: parity rows (feature error vs bf16, greedy tokens), both encoders at 64 tiles against
  # the FP8 floor (~5 min)
  timeout 130 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|'
  timeout 200 python3 bench/vit.py --batches 64 --fp8 --skip-hf 2>&1 | tee "$out/vit.log" | grep -E 'fp8|^\|' | tail -12 ;;
fp8-e2e)  # the 38B seed job's first 250 requests with and without the FP8 ViT (two ViT compiles up front; ~8 min)
  timeout 560 python3 bench/e2e.py --n 250 --modes nocache,nocache+fp8 \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
attn-8b)  # why per-sequence cuDNN prefill (1.6x flash varlen alone) did not speed up the 8B job: plan building per
  # window, alone and in the compiled prefill; then the job with every window's plan built before the clock (~8 min)
  timeout 150 python3 bench/probe.py attn-job 2>&1 | tee "$out/probe_attn_job.log" | grep -E '^\||Error|error'
  timeout 390 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,nocache+cudnn,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
e2e-8b-hf64)  # the 8B seed job (default attention: cuDNN per sequence on Hopper) vs transformers at b=32 AND b=64
  # (its best batch was only ever searched up to 32), on 128 requests (~6 min)
  timeout 560 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 128 --hf-batches 32,64 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|windows|^\||ceiling|RESULT|Error' ;;
e2e-38b)  # the 38B seed job (no caches) vs transformers b=16, alone (the tuned ViT compile took ~80-120 s up front);
  # since session 5 "nocache" prefills with the per-sequence cuDNN attention on Hopper (auto)
  timeout 500 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error' ;;
e2e-cudnn)  # the 38B seed job (no caches) vs transformers b=16; the 8B one, also with per-sequence cuDNN attention
  timeout 300 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error'
  timeout 250 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf,nocache+cudnn 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error' ;;
vit64)  # parity of every fast path, then both encoders at 64 tiles: ours eager / compiled / + GELU epilogue, transformers
  timeout 150 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|'
  timeout 390 python3 bench/vit.py --batches 64 --mode default --hf-mode default --budget-s 300 \
    2>&1 | tee "$out/vit.log" | grep -E 'floor|compile|^\||attention' | tail -30 ;;
vit)  # both encoders, 16/64/128 tiles, ours vs transformers (default compile mode: max-autotune took 133 s a bucket)
  timeout 560 python3 bench/vit.py --batches 16,64,128 --mode default --hf-mode default --budget-s 480 \
    2>&1 | tee "$out/vit.log" | grep -E 'tiles/s|floor|compile|^\|' | tail -40 ;;
parity38-e2e)  # the short form of parity-e2e for a small device budget: 38B parity only
  timeout 70 python3 bench/gpu_parity.py internvl2_5-38b 2>&1 | tee "$out/parity.log" | grep '^|'
  timeout 480 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 8,16 --modes nocache,hf,cache \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
parity-e2e)  # parity of every fast path (~70 s), then the seed job as in `e2e` with what time is left
  timeout 110 python3 bench/gpu_parity.py 2>&1 | tee "$out/parity.log" | grep '^|'
  timeout 460 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 8,16 --modes nocache,hf,cache \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
e2e-both)  # 38B without caches vs transformers (caches measured at 21x in session 2), then 8B the same way
  timeout 330 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error'
  timeout 220 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error' ;;
final)  # prefill attention backends alone; the 38B seed job (no caches) vs transformers; the 8B one, also with the
  # LLM prefill attention per sequence through cuDNN (~8 min)
  timeout 45 python3 bench/probe.py attn 2>&1 | grep -vE 'Warning|warn' | tail -20
  timeout 330 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 16 --modes nocache,hf \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error'
  timeout 200 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 32 --budget 65536 \
    --modes nocache,hf,nocache+cudnn 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|^\||ceiling|RESULT|Error' ;;
e2e)  # the seed job at 38B shapes: no caches, caches, transformers at two batch sizes (~7 min)
  timeout 570 python3 bench/e2e.py --n 500 --hf-n 32 --hf-batches 8,16 --modes nocache,hf,cache \
    2>&1 | tee "$out/e2e.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
e2e-fast)  # the unmeasured option: the ViT under the previous decode, with and without caches
  timeout 560 python3 bench/e2e.py --n 500 --hf-n 16 --hf-batches 16 \
    --modes nocache+overlap,cache+overlap,hf 2>&1 | tee "$out/e2e_fast.log" \
    | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
e2e-8b)  # InternViT-300M + InternLM2.5-7B shapes (transformers runs the LLM as Llama, which it is once unpacked);
  # first the runner itself on the GPU: the demo job in bf16 with the compiled ViT and a worker pool (pinned tiles)
  timeout 150 python3 -m batchvl.runner jobs/demo.yaml --set model.device=cuda --set model.dtype=bfloat16 \
    --set engine.compile_vit=true --set preprocess.workers=2 --set output.dir="$out/demo_gpu" --overwrite \
    2>&1 | tail -8
  timeout 560 python3 bench/e2e.py --preset internvl2_5-8b --n 500 --hf-n 64 --hf-batches 16,32 --budget 65536 \
    --modes nocache,hf 2>&1 | tee "$out/e2e_8b.log" | grep -E 'compiled|stages|graphs captured|greedy|^\||ceiling|RESULT|Error' ;;
esac
