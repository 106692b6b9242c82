// Dense attention: the policy without a plan (see dense_policy.h).
#include "inference_rank/policies/dense/dense_policy.h"

#include "common/yaml_map_reader.h"

namespace rubato {

const PolicyTraits& DensePolicy::traits() const {
  static const PolicyTraits traits{ResidencySet{KvResidency::kLocal, KvResidency::kOffloaded},
                                   true};
  return traits;
}

Result<std::unique_ptr<AttentionBackend>> DensePolicy::MakeBackend(Model& /*model*/,
                                                                   int /*max_batch*/) const {
  return std::unique_ptr<AttentionBackend>();
}

std::unique_ptr<PolicyRequest> DensePolicy::Admit(KvResidency /*residency*/) { return nullptr; }

Result<std::unique_ptr<AttentionPolicy>> CreateDensePolicy(const PolicySection& section) {
  RUBATO_ASSIGN_OR_RETURN(YamlMapReader params, section.ParamsReader());
  RUBATO_RETURN_IF_ERROR(params.Finish());
  return std::unique_ptr<AttentionPolicy>(new DensePolicy());
}

}  // namespace rubato
