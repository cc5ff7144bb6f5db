-- Finalize, last step: give back the business keys $1 leased to $2, after
-- their messages were deleted or parked (see internal/keylock's Finalize);
-- a key the delete leased 'in-flight' stays so. Keys in $3 failed with a
-- retriable error: they stay leased to no one for a back-off that doubles
-- with each consecutive failure, from $4 up to $5, which is how dispatch
-- backs off from a broker that is down without holding a transaction or a
-- worker. A key that published resets its count. Unordered heads are
-- released by dispatch_release_unordered.sql, the same statement by
-- head_id: with both in one WHERE (business_key = ANY ... OR head_id =
-- ANY ...) no single index serves it, and the planner read every head
-- below about 65,000 keys (docs/benchmarks.md, "Three plans fixed").
--
-- Deliberately one plain UPDATE with no self-join: a row updated by someone
-- else meanwhile is then re-checked on its new version and still released.
-- A join on ctid would silently skip it, leaking the lease.
UPDATE deferred_key
SET leased_by = NULL,
    failures = CASE WHEN business_key = ANY ($3::text[]) THEN failures + 1 ELSE 0 END,
    leased_until = CASE WHEN business_key = ANY ($3::text[])
                        THEN now() + least($5::interval, $4::interval * power(2, least(failures, 30)))
                   END
WHERE leased_by = $2::text AND business_key = ANY ($1::text[])
