// Declarations of the part of Apple's Metal framework that csrc/metal/ uses, so the
// Objective-C++ host can be type-checked on Linux (scripts/check_metal_host.sh) with clang
// -fsyntax-only against GNUstep's Foundation. This is NOT Apple's header: it is written here,
// and every selector, parameter type, nullability and enum value below was checked against
// Apple's Metal headers / documentation. It declares, it implements nothing; on a Mac the real
// <Metal/Metal.h> is used instead. Add a declaration here (checked the same way) when the host
// starts to use a new API: tests/test_metal_host.py fails on any selector, property, class,
// constant or enum value that Apple's API does not have (tests/metal_host/metal_api.txt, the
// list scripts/metal_api_list.py extracts from metal-cpp).
#pragma once
#import <Foundation/Foundation.h>

#ifdef __cplusplus
#define MTL_EXTERN extern "C" __attribute__((visibility("default")))
#else
#define MTL_EXTERN extern __attribute__((visibility("default")))
#endif

#ifndef NS_RETURNS_INNER_POINTER  // (GNUstep lacks it; Apple's Foundation defines it so)
#define NS_RETURNS_INNER_POINTER __attribute__((objc_returns_inner_pointer))
#endif

NS_ASSUME_NONNULL_BEGIN

// ---- MTLTypes.h ----------------------------------------------------------------------------
typedef struct {
  NSUInteger width, height, depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize size = {width, height, depth};
  return size;
}

// ---- MTLResource.h -------------------------------------------------------------------------
typedef NS_ENUM(NSUInteger, MTLCPUCacheMode) {
  MTLCPUCacheModeDefaultCache = 0,
  MTLCPUCacheModeWriteCombined = 1,
};
typedef NS_ENUM(NSUInteger, MTLStorageMode) {
  MTLStorageModeShared = 0,
  MTLStorageModeManaged = 1,
  MTLStorageModePrivate = 2,
  MTLStorageModeMemoryless = 3,
};
typedef NS_ENUM(NSUInteger, MTLHazardTrackingMode) {
  MTLHazardTrackingModeDefault = 0,
  MTLHazardTrackingModeUntracked = 1,
  MTLHazardTrackingModeTracked = 2,
};
#define MTLResourceCPUCacheModeShift 0
#define MTLResourceStorageModeShift 4
#define MTLResourceHazardTrackingModeShift 8
typedef NS_OPTIONS(NSUInteger, MTLResourceOptions) {
  MTLResourceCPUCacheModeDefaultCache = MTLCPUCacheModeDefaultCache << MTLResourceCPUCacheModeShift,
  MTLResourceCPUCacheModeWriteCombined = MTLCPUCacheModeWriteCombined << MTLResourceCPUCacheModeShift,
  MTLResourceStorageModeShared = MTLStorageModeShared << MTLResourceStorageModeShift,
  MTLResourceStorageModeManaged = MTLStorageModeManaged << MTLResourceStorageModeShift,
  MTLResourceStorageModePrivate = MTLStorageModePrivate << MTLResourceStorageModeShift,
  MTLResourceHazardTrackingModeDefault = MTLHazardTrackingModeDefault << MTLResourceHazardTrackingModeShift,
  MTLResourceHazardTrackingModeUntracked = MTLHazardTrackingModeUntracked << MTLResourceHazardTrackingModeShift,
  MTLResourceHazardTrackingModeTracked = MTLHazardTrackingModeTracked << MTLResourceHazardTrackingModeShift,
};

@protocol MTLDevice;

// ---- MTLAllocation.h (macOS 15) --------------------------------------------------------------
@protocol MTLAllocation <NSObject>
@property(readonly) NSUInteger allocatedSize;
@end

@protocol MTLResource <MTLAllocation>
@property(nullable, copy, atomic) NSString* label;
@property(readonly) id<MTLDevice> device;
@property(readonly) MTLStorageMode storageMode;
@end

// ---- MTLBuffer.h ---------------------------------------------------------------------------
typedef uint64_t MTLGPUAddress;
@protocol MTLBuffer <MTLResource>
@property(readonly) NSUInteger length;
- (void*)contents NS_RETURNS_INNER_POINTER;
@property(readonly) MTLGPUAddress gpuAddress;  // macOS 13
@end

// ---- MTLArgument.h (the function-constant types lily uses) ----------------------------------
typedef NS_ENUM(NSUInteger, MTLDataType) {
  MTLDataTypeNone = 0,
  MTLDataTypeFloat = 3,
  MTLDataTypeHalf = 16,
  MTLDataTypeInt = 29,
  MTLDataTypeUInt = 33,
  MTLDataTypeShort = 37,
  MTLDataTypeUShort = 41,
  MTLDataTypeBool = 53,
};

// ---- MTLFunctionConstantValues.h -----------------------------------------------------------
@interface MTLFunctionConstantValues : NSObject <NSCopying>
- (void)setConstantValue:(const void*)value type:(MTLDataType)type atIndex:(NSUInteger)index;
- (void)setConstantValues:(const void*)values type:(MTLDataType)type withRange:(NSRange)range;
- (void)setConstantValue:(const void*)value type:(MTLDataType)type withName:(NSString*)name;
- (void)reset;
@end

// ---- MTLLibrary.h --------------------------------------------------------------------------
typedef NS_ENUM(NSUInteger, MTLLanguageVersion) {
  MTLLanguageVersion3_0 = (3 << 16) + 0,
  MTLLanguageVersion3_1 = (3 << 16) + 1,
  MTLLanguageVersion3_2 = (3 << 16) + 2,
  MTLLanguageVersion4_0 = (4 << 16) + 0,  // macOS 26
};
typedef NS_ENUM(NSInteger, MTLMathMode) {  // macOS 15
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
};

@interface MTLCompileOptions : NSObject <NSCopying>
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@property(nullable, readwrite, copy, nonatomic) NSDictionary<NSString*, NSObject*>* preprocessorMacros;
@property(readwrite, nonatomic) BOOL fastMathEnabled;     // deprecated in macOS 15 for mathMode
@property(readwrite, nonatomic) MTLMathMode mathMode;     // macOS 15
@end

@protocol MTLFunction <NSObject>
@property(nullable, copy, atomic) NSString* label;
@property(readonly) id<MTLDevice> device;
@property(readonly) NSString* name;
@end

@protocol MTLLibrary <NSObject>
@property(nullable, copy, atomic) NSString* label;
@property(readonly) id<MTLDevice> device;
@property(readonly) NSArray<NSString*>* functionNames;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)name
                                 constantValues:(MTLFunctionConstantValues*)constantValues
                                          error:(__autoreleasing NSError**)error;
@end

// ---- MTLComputePipeline.h ------------------------------------------------------------------
@protocol MTLComputePipelineState <NSObject>
@property(nullable, readonly) NSString* label;
@property(readonly) id<MTLDevice> device;
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@property(readonly) NSUInteger threadExecutionWidth;
@property(readonly) NSUInteger staticThreadgroupMemoryLength;
@end

// ---- MTLCommandEncoder.h / MTLComputeCommandEncoder.h --------------------------------------
typedef NS_OPTIONS(NSUInteger, MTLResourceUsage) {
  MTLResourceUsageRead = 1 << 0,
  MTLResourceUsageWrite = 1 << 1,
};
typedef NS_OPTIONS(NSUInteger, MTLBarrierScope) {
  MTLBarrierScopeBuffers = 1 << 0,
  MTLBarrierScopeTextures = 1 << 1,
  MTLBarrierScopeRenderTargets = 1 << 2,
};

@protocol MTLCommandEncoder <NSObject>
@property(readonly) id<MTLDevice> device;
@property(nullable, copy, atomic) NSString* label;
- (void)endEncoding;
- (void)insertDebugSignpost:(NSString*)string;
- (void)pushDebugGroup:(NSString*)string;
- (void)popDebugGroup;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBufferOffset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid
       threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)dispatchThreads:(MTLSize)threadsPerGrid
    threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
- (void)memoryBarrierWithScope:(MTLBarrierScope)scope;
- (void)useResource:(id<MTLResource>)resource usage:(MTLResourceUsage)usage;
- (void)memoryBarrierWithResources:(const id<MTLResource> _Nonnull[_Nonnull])resources
                             count:(NSUInteger)count;
@end

// ---- MTLCommandBuffer.h --------------------------------------------------------------------
typedef NS_ENUM(NSUInteger, MTLDispatchType) {
  MTLDispatchTypeSerial,
  MTLDispatchTypeConcurrent,
};
typedef NS_OPTIONS(NSUInteger, MTLCommandBufferErrorOption) {
  MTLCommandBufferErrorOptionNone = 0,
  MTLCommandBufferErrorOptionEncoderExecutionStatus = 1 << 0,
};
typedef NS_ENUM(NSInteger, MTLCommandEncoderErrorState) {
  MTLCommandEncoderErrorStateUnknown = 0,
  MTLCommandEncoderErrorStateCompleted = 1,
  MTLCommandEncoderErrorStateAffected = 2,
  MTLCommandEncoderErrorStatePending = 3,
  MTLCommandEncoderErrorStateFaulted = 4,
};
// NSErrorUserInfoKey in Apple's Foundation (a typedef of NSString*, which GNUstep lacks).
MTL_EXTERN NSString* const MTLCommandBufferEncoderInfoErrorKey;

@interface MTLCommandBufferDescriptor : NSObject <NSCopying>
@property(readwrite, nonatomic) BOOL retainedReferences;
@property(readwrite, nonatomic) MTLCommandBufferErrorOption errorOptions;
@end

@protocol MTLCommandBufferEncoderInfo <NSObject>
@property(readonly, nonatomic) NSString* label;
@property(readonly, nonatomic) NSArray<NSString*>* debugSignposts;
@property(readonly, nonatomic) MTLCommandEncoderErrorState errorState;
@end

typedef NS_ENUM(NSUInteger, MTLCommandBufferStatus) {
  MTLCommandBufferStatusNotEnqueued = 0,
  MTLCommandBufferStatusEnqueued = 1,
  MTLCommandBufferStatusCommitted = 2,
  MTLCommandBufferStatusScheduled = 3,
  MTLCommandBufferStatusCompleted = 4,
  MTLCommandBufferStatusError = 5,
};

@protocol MTLCommandBuffer <NSObject>
@property(readonly) id<MTLDevice> device;
@property(nullable, copy, atomic) NSString* label;
@property(readonly) MTLCommandBufferStatus status;
@property(nullable, readonly) NSError* error;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (nullable id<MTLComputeCommandEncoder>)computeCommandEncoderWithDispatchType:(MTLDispatchType)dispatchType;
- (void)enqueue;
- (void)commit;
- (void)waitUntilScheduled;
- (void)waitUntilCompleted;
@end

// ---- MTLResidencySet.h (macOS 15) ----------------------------------------------------------
@interface MTLResidencySetDescriptor : NSObject <NSCopying>
@property(nullable, copy, nonatomic) NSString* label;
@property(nonatomic) NSUInteger initialCapacity;
@end

@protocol MTLResidencySet <NSObject>
@property(readonly) id<MTLDevice> device;
@property(nullable, readonly) NSString* label;
@property(readonly) uint64_t allocatedSize;
- (void)requestResidency;
- (void)endResidency;
- (void)addAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllocation:(id<MTLAllocation>)allocation;
- (void)removeAllAllocations;
- (BOOL)containsAllocation:(id<MTLAllocation>)anAllocation;
@property(readonly) NSUInteger allocationCount;
- (void)commit;
@end

// ---- MTLCommandQueue.h ---------------------------------------------------------------------
@protocol MTLCommandQueue <NSObject>
@property(nullable, copy, atomic) NSString* label;
@property(readonly) id<MTLDevice> device;
- (nullable id<MTLCommandBuffer>)commandBuffer;
- (nullable id<MTLCommandBuffer>)commandBufferWithUnretainedReferences;
- (nullable id<MTLCommandBuffer>)commandBufferWithDescriptor:(MTLCommandBufferDescriptor*)descriptor;
- (void)addResidencySet:(id<MTLResidencySet>)residencySet;     // macOS 15
- (void)removeResidencySet:(id<MTLResidencySet>)residencySet;  // macOS 15
@end

// ---- MTLDevice.h ---------------------------------------------------------------------------
typedef NS_ENUM(NSInteger, MTLGPUFamily) {
  MTLGPUFamilyApple1 = 1001,
  MTLGPUFamilyApple2 = 1002,
  MTLGPUFamilyApple3 = 1003,
  MTLGPUFamilyApple4 = 1004,
  MTLGPUFamilyApple5 = 1005,
  MTLGPUFamilyApple6 = 1006,
  MTLGPUFamilyApple7 = 1007,
  MTLGPUFamilyApple8 = 1008,
  MTLGPUFamilyApple9 = 1009,
  MTLGPUFamilyApple10 = 1010,  // macOS 26 (M5)
  MTLGPUFamilyMac2 = 2002,
  MTLGPUFamilyCommon1 = 3001,
  MTLGPUFamilyCommon2 = 3002,
  MTLGPUFamilyCommon3 = 3003,
  MTLGPUFamilyMetal3 = 5001,
  MTLGPUFamilyMetal4 = 5002,  // macOS 26
};

@protocol MTLDevice <NSObject>
@property(readonly) NSString* name;
@property(readonly) BOOL hasUnifiedMemory;
@property(readonly) NSUInteger maxThreadgroupMemoryLength;
@property(readonly) MTLSize maxThreadsPerThreadgroup;
@property(readonly) uint64_t recommendedMaxWorkingSetSize;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily;
- (nullable id<MTLCommandQueue>)newCommandQueue;
- (nullable id<MTLBuffer>)newBufferWithLength:(NSUInteger)length options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytes:(const void*)pointer
                                      length:(NSUInteger)length
                                     options:(MTLResourceOptions)options;
- (nullable id<MTLBuffer>)newBufferWithBytesNoCopy:(void*)pointer
                                            length:(NSUInteger)length
                                           options:(MTLResourceOptions)options
                                       deallocator:(void (^_Nullable)(void* pointer, NSUInteger length))deallocator;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError**)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(__autoreleasing NSError**)error;
- (nullable id<MTLResidencySet>)newResidencySetWithDescriptor:(MTLResidencySetDescriptor*)desc
                                                        error:(__autoreleasing NSError**)error;  // macOS 15
@end

MTL_EXTERN id<MTLDevice> _Nullable MTLCreateSystemDefaultDevice(void) NS_RETURNS_RETAINED;

NS_ASSUME_NONNULL_END
