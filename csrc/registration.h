/* What registration.c offers besides the register methods (communicator.h
 * declares those): the pyccl.Registration type, for the module, and the end
 * of a communicator's open registrations, which the type calls when a
 * communicator goes: the one call from a layer into a higher one
 * (docs/ARCHITECTURE.md says why). */
#ifndef PYCCL_REGISTRATION_H
#define PYCCL_REGISTRATION_H

#include "pyccl.h"

extern PyType_Spec pyccl_reg_spec;
/* Before c's handle goes: deregister its open handles; `forget` 1 (exit) or
 * 2 (abort()): mark them closed without calling NCCL.  Errors are dropped:
 * the communicator goes either way. */
void pyccl_release_registrations(pyccl_state *st, pyccl_comm *c, int forget);

#endif /* PYCCL_REGISTRATION_H */
