// The local residency's factory (see local_residency.h).
#include "inference_rank/residency/local/local_residency.h"

namespace rubato {

Result<std::shared_ptr<Residency>> CreateLocalResidency(const ResidencySetup& /*setup*/) {
  return std::shared_ptr<Residency>(std::make_shared<LocalResidency>());
}

}  // namespace rubato
