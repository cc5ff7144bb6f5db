-- deferred_key_after_truncate: TRUNCATE fires no DELETE trigger; without
-- this, heads would point at messages that no longer exist.

CREATE OR REPLACE FUNCTION deferred_key_after_truncate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    TRUNCATE deferred_key;
    RETURN NULL;
END
$$;
