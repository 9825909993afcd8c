/* The BLAS calls kvt leans on, timed: sgemm (the CPU backend's fp32 path) and the float64
 * dsyrk / dgemm of `kvt fit`'s statistics, and the core OpenBLAS picked for this CPU. Built by
 * Bazel against Debian's OpenBLAS; -DSCIPY builds it against PyPI's scipy-openblas32 (current
 * OpenBLAS, symbols prefixed scipy_) by hand:
 *   W=$(python -c 'import scipy_openblas32 as s, os; print(os.path.dirname(s.__file__))')
 *   gcc -O2 -DSCIPY -I$W/include tools/kernel_probes/blas_probe.c -L$W/lib -lscipy_openblas \
 *       -Wl,-rpath,$W/lib -o /tmp/blas_scipy && taskset -c 1 /tmp/blas_scipy 1
 * Arg: OpenBLAS threads. docs/BENCHMARKS.md, "Which libraries". */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef SCIPY
#include "cblas.h"
#define SGEMM scipy_cblas_sgemm
#define DSYRK scipy_cblas_dsyrk
#define DGEMM scipy_cblas_dgemm
#define CORE scipy_openblas_get_corename
#define NT scipy_openblas_set_num_threads
#else
#include <cblas.h>
#define SGEMM cblas_sgemm
#define DSYRK cblas_dsyrk
#define DGEMM cblas_dgemm
#define CORE openblas_get_corename
#define NT openblas_set_num_threads
char* openblas_get_corename(void); void openblas_set_num_threads(int);
#endif
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
int main(int c, char**v){ if(c<2){fprintf(stderr,"usage: %s threads\n",v[0]);return 2;} int th=atoi(v[1]); NT(th);
  long M=512,K=2048,N=1024; float*a=malloc(4*M*K),*b=malloc(4*K*N),*cc=malloc(4*M*N); for(long i=0;i<M*K;i++)a[i]=(i%7)*0.1f; for(long i=0;i<K*N;i++)b[i]=(i%5)*0.1f;
  double best=1e9; for(int r=0;r<10;r++){double t=now(); SGEMM(CblasRowMajor,CblasNoTrans,CblasNoTrans,M,N,K,1,a,K,b,N,0,cc,N); t=now()-t; if(t<best)best=t;}
  printf("%s core=%s threads=%d sgemm %ldx%ldx%ld %.1f GFLOP/s\n", v[0], CORE(), th, M,K,N, 2.0*M*K*N/best/1e9);
  long T=4096, D=2048; double*x=malloc(8*T*D),*g=malloc(8*D*D); for(long i=0;i<T*D;i++)x[i]=(i%11)*0.01;
  best=1e9; for(int r=0;r<3;r++){double t=now(); DSYRK(CblasRowMajor,CblasUpper,CblasTrans,D,T,1,x,D,0,g,D); t=now()-t; if(t<best)best=t;}
  printf("%s threads=%d dsyrk X^T X %ldx%ld %.1f GFLOP/s\n", v[0], th, T, D, 1.0*T*D*D/best/1e9);
  best=1e9; for(int r=0;r<3;r++){double t=now(); DGEMM(CblasRowMajor,CblasTrans,CblasNoTrans,D,D/2,T,1,x,D,x,D,0,g,D); t=now()-t; if(t<best)best=t;}
  printf("%s threads=%d dgemm X^T Y %ldx%ldx%ld %.1f GFLOP/s\n", v[0], th, D, T, D/2, 2.0*T*D*D/2/best/1e9);
}
