# nemoh: `make` builds ./nemoh; with nvcc present it adds the CUDA backend (nemoh.cu), otherwise it
# builds the CPU engine from nemoh.c alone with any C compiler.
CC ?= cc
NATIVE := $(shell $(CC) -march=native -E -x c /dev/null >/dev/null 2>&1 && echo -march=native)
OPENMP := $(shell echo 'int main(void){return 0;}' | $(CC) -fopenmp -x c - -o /dev/null 2>/dev/null && echo -fopenmp)
CFLAGS ?= -O3 $(NATIVE) -Wall -Wextra
LDLIBS = -lm -lpthread

nemoh: nemoh.c nemoh.h
	$(CC) -std=c11 $(CFLAGS) $(OPENMP) nemoh.c -o $@ $(LDLIBS)

clean:
	rm -f nemoh *.o

.PHONY: clean
