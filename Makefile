# nemoh: `make` builds ./nemoh. Where nvcc is found it adds the CUDA backend (nemoh.cu: cuBLAS, NCCL);
# otherwise it builds the CPU engine from nemoh.c alone, with any C compiler.
CC ?= cc
NATIVE := $(shell $(CC) -march=native -E -x c /dev/null >/dev/null 2>&1 && echo -march=native)
OPENMP := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
# without OpenMP a rank's loops run on one thread, and their pragmas are ignored without a warning
OMPFLAGS := $(or $(OPENMP),-Wno-unknown-pragmas)
# a * b + c as one fused multiply-add where the CPU has one: ISO C mode (-std=c11) turns that off in
# gcc, which left the CPU's dot products two instructions an element (the default model's decode
# 6% slower, its lm_head for 4 tokens 25%)
FPCONTRACT := $(shell $(CC) -ffp-contract=fast -E -x c /dev/null >/dev/null 2>&1 && echo -ffp-contract=fast)
CFLAGS ?= -O3 $(NATIVE) $(FPCONTRACT) -Wall -Wextra
LDLIBS = -lm -lpthread

NVCC ?= $(shell command -v nvcc 2>/dev/null)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# NCCL >= 2.28 for the device API. A pip-installed NCCL (nvidia-nccl-cu13, as PyTorch brings it) is
# preferred: on machines whose system NCCL is older, ncclDevCommCreate fails there.
NCCL_HOME ?= $(or $(shell python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null),$(CUDA_HOME))
NCCL_LIB := $(or $(firstword $(wildcard $(NCCL_HOME)/lib/libnccl.so.2 $(NCCL_HOME)/lib64/libnccl.so.2)),-lnccl)
# How cc and nvcc both link NCCL: a library file found above is linked by path and its directory
# becomes the binary's run path (one spelling both drivers pass through to ld); else -lnccl.
NCCL_LINK := $(if $(findstring /,$(NCCL_LIB)),-Xlinker -rpath=$(dir $(NCCL_LIB)) -Xlinker $(NCCL_LIB),-lnccl)
# The GPU architecture: Hopper only by default (see README, "GPU requirement").
CUDA_ARCH ?= -gencode arch=compute_90a,code=sm_90a

ifneq ($(NVCC),)
# the engine with the CUDA backend
nemoh: nemoh.c nemoh.h nemoh_cuda.o Makefile
	$(CC) -std=c11 $(CFLAGS) $(OMPFLAGS) -DNEMOH_CUDA nemoh.c nemoh_cuda.o -o $@ -L$(CUDA_HOME)/lib64 $(NCCL_LINK) -lcublas \
	    -lcudart -lstdc++ $(LDLIBS)

NVFLAGS = -std=c++17 -O3 $(CUDA_ARCH) -DNEMOH_CUDA -I$(NCCL_HOME)/include -Xcompiler -Wall
# the CUDA backend
nemoh_cuda.o: nemoh.cu nemoh.h Makefile
	$(NVCC) $(NVFLAGS) -c nemoh.cu -o $@

# the kernels one by one against float64 host references (test.sh runs it where a GPU exists)
tests/test_kernels: tests/test_kernels.cu nemoh.cu nemoh.h Makefile
	$(NVCC) $(NVFLAGS) tests/test_kernels.cu -o $@ $(NCCL_LINK) -lcublas
else
# the CPU engine alone
nemoh: nemoh.c nemoh.h Makefile
	$(CC) -std=c11 $(CFLAGS) $(OMPFLAGS) nemoh.c -o $@ $(LDLIBS)
endif

# every test (./test.sh: builds from scratch, ends with "N passed, M failed")
test:
	./test.sh

# remove what make builds
clean:
	rm -f nemoh *.o tests/test_kernels

.PHONY: test clean

# the libFuzzer harnesses of tests/fuzz (clang), all five at once for FUZZ_SECONDS each
FUZZ_SECONDS ?= 60
fuzz:
	tests/fuzz/run.sh $(FUZZ_SECONDS)

.PHONY: fuzz
