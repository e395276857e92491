/* What a mark behind NCCL's work costs the host: a CUDA event record against a
 * stream memop writing a host-mapped word (cuStreamWriteValue), the capture
 * checks, an event query; alone and after a one-rank 8-byte ncclAllReduce,
 * 20,000 back to back, three times.  One GPU.
 *   nvcc -O2 -o mark_cost tools/mark_cost.c -I<nccl>/include -L<nccl>/lib -l:libnccl.so.2 \
 *        -Xlinker -rpath=<nccl>/lib -L<cuda>/lib64/stubs -lcuda
 *   ./mark_cost */
#include <cuda.h>
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+1e-9*t.tv_nsec;}
#define N 20000
#define CK(x) do{int e_=(int)(x); if(e_){printf("ERR %s = %d line %d\n",#x,e_,__LINE__);return 1;}}while(0)
int main(void){
  CK(cudaSetDevice(0)); cudaFree(0);
  cudaStream_t s; CK(cudaStreamCreateWithFlags(&s,cudaStreamNonBlocking));
  cudaEvent_t ev, pool[64]; CK(cudaEventCreateWithFlags(&ev,cudaEventDisableTiming));
  for(int i=0;i<64;i++) CK(cudaEventCreateWithFlags(&pool[i],cudaEventDisableTiming));
  uint64_t *h; CK(cudaHostAlloc((void**)&h,64*8,cudaHostAllocMapped)); for(int i=0;i<64;i++)h[i]=0;
  void *dp; CK(cudaHostGetDevicePointer(&dp,h,0)); CUdeviceptr d=(CUdeviceptr)dp;
  CUdevice dev; CK(cuDeviceGet(&dev,0)); int a1=-1,a2=-1;
  cuDeviceGetAttribute(&a1,CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,dev);
  cuDeviceGetAttribute(&a2,CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,dev);
  printf("attr 64bit memops %d hostptr %d host==dev %d\n",a1,a2,(void*)h==dp);
  ncclComm_t comm; int devs[1]={0}; CK(ncclCommInitAll(&comm,1,devs));
  float *x; CK(cudaMalloc((void**)&x,256));
  enum cudaStreamCaptureStatus cs; CUstreamCaptureStatus dcs;
  for(int rep=0;rep<3;rep++){
    double t; printf("-- rep %d (us per op, %d ops)\n",rep,N);
#define T(name, body) do{ CK(cudaStreamSynchronize(s)); t=now(); for(int i=0;i<N;i++){ body; } double u=(now()-t)*1e6/N; CK(cudaStreamSynchronize(s)); printf("%-44s %7.3f\n",name,u);}while(0)
    T("cudaEventRecord same event", CK(cudaEventRecord(ev,s)));
    T("cudaEventRecord pool of 64", CK(cudaEventRecord(pool[i&63],s)));
    T("cuStreamWriteValue64 default", CK(cuStreamWriteValue64(s,d+8*(i&63),i,0)));
    T("cuStreamWriteValue32 default", CK(cuStreamWriteValue32(s,d+8*(i&63),i,0)));
    T("cudaStreamIsCapturing", CK(cudaStreamIsCapturing(s,&cs)));
    T("cuStreamIsCapturing", CK(cuStreamIsCapturing(s,&dcs)));
    T("cudaStreamGetCaptureInfo", CK(cudaStreamGetCaptureInfo(s,&cs,NULL,NULL,NULL,NULL,NULL)));
    T("cudaEventQuery (done)", cudaEventQuery(ev));
    T("volatile host read", (void)*(volatile uint64_t*)&h[i&63]);
    T("ncclAllReduce 8B (1 rank)", CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s)));
    T("ncclAllReduce + cudaEventRecord pool", CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s));CK(cudaEventRecord(pool[i&63],s)));
    T("ncclAllReduce + cudaStreamIsCapturing+Record", CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s));CK(cudaStreamIsCapturing(s,&cs));CK(cudaEventRecord(pool[i&63],s)));
    T("ncclAllReduce + cuStreamWriteValue64", CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s));CK(cuStreamWriteValue64(s,d+8*(i&63),i,0)));
    T("ncclAllReduce + IsCapturing+WriteValue64", CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s));CK(cudaStreamIsCapturing(s,&cs));CK(cuStreamWriteValue64(s,d+8*(i&63),i,0)));
    T("ncclAllReduce + WriteValue64 every 16th", CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s));if((i&15)==0){CK(cudaStreamIsCapturing(s,&cs));CK(cuStreamWriteValue64(s,d+8*(i&63),i,0));});
  }
  /* the write lands after the work before it */
  CK(cudaStreamSynchronize(s)); h[5]=0; CK(ncclAllReduce(x,x,2,ncclFloat,ncclSum,comm,s)); CK(cuStreamWriteValue64(s,d+40,777,0));
  double t0=now(); while(*(volatile uint64_t*)&h[5]!=777 && now()-t0<5); printf("write seen after %.1f us\n",(now()-t0)*1e6);
  ncclCommDestroy(comm); return 0;
}
