// One oneDNN matmul timed single-threaded: which oneDNN build is faster on this CPU, with the
// rest of kvt out of the picture. Built by Bazel against Debian's oneDNN 2.6.3; the same file
// builds against any other oneDNN (2.x or 3.x API) by hand, e.g. PyPI's onednn-devel in a venv:
//   g++ -O2 -std=c++17 -I$VENV/include tools/kernel_probes/onednn_matmul_probe.cc \
//       -L$VENV/lib -ldnnl -o /tmp/probe3
//   LD_LIBRARY_PATH=$VENV/lib OCL_ICD_FILENAMES=$VENV/lib/libintelocl.so taskset -c 1 \
//       /tmp/probe3 512 2048 1024 20 [f32]
// (PyPI's build runs its CPU engine on the SYCL runtime, which needs the OpenCL CPU runtime:
// hence OCL_ICD_FILENAMES.) Args: M K N repetitions [f32]; weights packed (format any).
// Prints the implementation and the best call's GFLOP/s. docs/BENCHMARKS.md, "Which libraries".
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <sys/resource.h>
#include "oneapi/dnnl/dnnl.hpp"
using namespace dnnl;
using dt = memory::data_type; using tag = memory::format_tag;
static double cpu_s() { rusage u; getrusage(RUSAGE_SELF, &u); return u.ru_utime.tv_sec + u.ru_utime.tv_usec*1e-6 + u.ru_stime.tv_sec + u.ru_stime.tv_usec*1e-6; }
int main(int argc, char** argv) {
  if (argc < 5) { fprintf(stderr, "usage: %s M K N repetitions [f32]\n", argv[0]); return 2; }
  long M = atol(argv[1]), K = atol(argv[2]), N = atol(argv[3]); int reps = atoi(argv[4]);
  dt wdt = (argc > 5 && argv[5][0]=='f') ? dt::f32 : dt::bf16;
  engine eng(engine::kind::cpu, 0); stream s(eng);
  memory::desc src({M,K}, wdt, tag::ab), w({K,N}, wdt, tag::any), dst({M,N}, dt::f32, tag::ab);
#if DNNL_VERSION_MAJOR >= 3
  matmul::primitive_desc pd(eng, src, w, dst);
#else
  matmul::primitive_desc pd(matmul::desc(src, w, dst), eng);
#endif
  memory ms(src, eng), mw(pd.weights_desc(), eng), md(dst, eng);
  size_t es = wdt==dt::bf16 ? 2 : 4;
  auto fill=[&](memory& m){ size_t n=m.get_desc().get_size()/es; if(es==2){auto*p=(uint16_t*)m.get_data_handle(); for(size_t i=0;i<n;i++)p[i]=0x3c00+(i%7);} else {auto*p=(float*)m.get_data_handle(); for(size_t i=0;i<n;i++)p[i]=0.01f*(i%7);} };
  fill(ms); fill(mw);
  matmul mm(pd);
  mm.execute(s, {{DNNL_ARG_SRC, ms},{DNNL_ARG_WEIGHTS, mw},{DNNL_ARG_DST, md}}); s.wait();
  double best=1e9; double c0=cpu_s(); auto t00=std::chrono::steady_clock::now();
  for (int r=0;r<reps;r++){ auto t0=std::chrono::steady_clock::now(); mm.execute(s, {{DNNL_ARG_SRC, ms},{DNNL_ARG_WEIGHTS, mw},{DNNL_ARG_DST, md}}); s.wait(); double t=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); if(t<best)best=t; }
  double wall=std::chrono::duration<double>(std::chrono::steady_clock::now()-t00).count(); double c=cpu_s()-c0;
  double fl=2.0*M*K*N;
  printf("dnnl %d.%d.%d %s impl=%s M=%ld K=%ld N=%ld best %.1f GFLOP/s, cpu-time %.1f GFLOP/s/core-s, wall avg %.1f\n", DNNL_VERSION_MAJOR, DNNL_VERSION_MINOR, DNNL_VERSION_PATCH, wdt==dt::bf16?"bf16":"f32", pd.impl_info_str(), M,K,N, fl/best/1e9, fl*reps/c/1e9, fl*reps/wall/1e9);
}
