/* What registration.c offers besides the register methods (communicator.h
 * declares those): the pyccl.Registration type, for the module.  The end of
 * a communicator's open registrations, which the type calls when a
 * communicator goes, is reg_list.h's, a layer below the type. */
#ifndef PYCCL_REGISTRATION_H
#define PYCCL_REGISTRATION_H

#include "pyccl.h"

extern PyType_Spec pyccl_reg_spec;

#endif /* PYCCL_REGISTRATION_H */
