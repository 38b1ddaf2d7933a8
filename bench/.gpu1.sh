python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && tar -C /tmp/site -xJf .whl/ray.tar.xz && export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import transformers, torch; print(transformers.__version__, torch.__version__)"
timeout 170 python3 tests/rollout/test_hf_engine_gpu.py > $OUT/gpu_test.log 2>&1; echo "test rc=$?"; tail -25 $OUT/gpu_test.log
timeout 380 python3 bench/agentic.py --shape 0.5b --n 256 --rows continuous+kv,continuous,generate,batch > $OUT/agentic_05b.log 2>&1; echo "bench rc=$?"; tail -12 $OUT/agentic_05b.log
