//! Custom resources as typed structs: [`custom_resource!`] gives a spec type the object around
//! it and kube's `Resource` (group, version, kind, plural), which is all rendering and the API
//! need. (kube's `CustomResource` derive does the same and more, but brings `schemars` in with
//! it to generate CRDs, which trainctl never does: it reads the operators' own.)

/// `custom_resource!(Name, Spec, "group", "version", "Kind", "plural")`: a namespaced object
/// `Name` with `metadata` and `spec: Spec`, served as `Kind`.
macro_rules! custom_resource {
    ($name:ident, $spec:ty, $group:literal, $version:literal, $kind:literal, $plural:literal) => {
        #[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
        pub(crate) struct $name {
            pub(crate) metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
            pub(crate) spec: $spec,
        }

        impl kube::Resource for $name {
            type DynamicType = ();
            type Scope = k8s_openapi::NamespaceResourceScope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                $group.into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }
    };
}
